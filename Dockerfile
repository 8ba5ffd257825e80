# gpt2-serve for a GPU node. The base image brings CUDA, PyTorch and Triton, so installing the
# project adds only the light dependencies (pip keeps the base image's torch).
#   docker build -t gpt2-serve .
#   docker run --gpus all -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface \
#       gpt2-serve --model gpt2-xl
# Any base with CUDA PyTorch >= 2.4 works: --build-arg BASE_IMAGE=pytorch/pytorch:<tag>
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/gpt2-serve
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY server ./server
COPY configs ./configs
COPY scripts ./scripts
RUN pip install .

EXPOSE 8000
# Loading a large checkpoint takes a while: give it a start period before failures count.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
# SIGTERM (docker stop) drains in-flight requests for up to --shutdown-timeout seconds; give
# `docker stop -t` at least that long.
STOPSIGNAL SIGTERM
ENTRYPOINT ["gpt2-serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--config", "configs/gpt2.yaml"]
