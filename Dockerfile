# gpt2-serve for a GPU node, with the torch and triton the GPU benchmarks ran
# (deploy/constraints.txt) and a C compiler at run time: Triton builds a small C launcher for
# each kernel the first time it runs (its cache, TRITON_CACHE_DIR, is a volume: warm restarts).
#   docker build -t gpt2-serve .
#   docker run --gpus all -p 8000:8000 -v hf-cache:/cache/huggingface \
#       -v triton-cache:/cache/triton gpt2-serve --model gpt2-xl
# The preset configs/<model name>.yaml follows from --model (gpt2-xl above); --config overrides.
# SIGTERM drains in-flight requests for up to --shutdown-timeout (30 s): `docker stop -t 40`.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
WORKDIR /opt/gpt2-serve
COPY deploy/constraints.txt deploy/constraints.txt
# torch first, in its own layer: it is most of the image and changes least often
RUN pip install --extra-index-url "$TORCH_INDEX_URL" -c deploy/constraints.txt torch triton
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY server server
COPY configs configs
COPY scripts scripts
# editable: the presets in configs/ stay beside the code that looks for them
RUN pip install -c deploy/constraints.txt -e .

FROM ${CUDA_IMAGE}
# gcc, libc headers and Python.h: what Triton compiles its kernel launchers with
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group gpt2 \
    && mkdir -p /cache/huggingface /cache/triton \
    && chown -R gpt2:gpt2 /cache
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/gpt2-serve /opt/gpt2-serve
WORKDIR /opt/gpt2-serve
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton
VOLUME ["/cache/huggingface", "/cache/triton"]
USER 10001:10001
EXPOSE 8000
# follows the server's own --host/--port (server/healthcheck.py reads its command line)
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-m", "server.healthcheck"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["gpt2-serve"]
CMD ["--model", "gpt2"]
