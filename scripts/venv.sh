# Sourced by quickstart.sh and test.sh: create and activate .venv, then install torch unless
# the venv has it already.
#   install_torch cpu    the CPU build, from TORCH_INDEX_URL (default PyTorch's CPU index;
#                        set TORCH_INDEX_URL to a mirror, or to "" for pip's configured index)
#   install_torch cuda   the CUDA build pinned by deploy/constraints.txt, from
#                        TORCH_CUDA_INDEX_URL (default PyTorch's CUDA 13.0 index; "" as above)
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate

install_torch() {
    if python -c "import torch" 2>/dev/null; then
        return
    fi
    if [ "$1" = cuda ]; then
        local index=${TORCH_CUDA_INDEX_URL-https://download.pytorch.org/whl/cu130}
        pip install -q --retries 0 ${index:+--extra-index-url "$index"} \
            -c deploy/constraints.txt torch triton
    else
        local index=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
        pip install -q --retries 0 ${index:+--index-url "$index"} "torch==2.13.0"
    fi
}
