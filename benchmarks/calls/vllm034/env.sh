# Source from the project root once the last part's recv.sh has unpacked /tmp/site034:
#     source .gpu034/pK/env.sh
# Puts vLLM 0.34.0, torch 2.14.0, triton 3.8.0 and torchvision 0.29.0 (in /tmp/site034) ahead of
# the image's torch 2.11 stack; the carried torchvision shadows the image's, built for torch 2.11.
if [ ! -f /tmp/site034/.bundle034-ok ]; then echo "[env034] /tmp/site034 is not complete: run the recv.sh calls first" >&2; fi
export PYTHONPATH="/tmp/site034:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# torch finds NCCL 2.30.7 through its RPATH ($ORIGIN/../../nvidia/nccl/lib); this also covers other loaders
export LD_LIBRARY_PATH="/tmp/site034/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export VLLM_NCCL_SO_PATH=/tmp/site034/nvidia/nccl/lib/libnccl.so.2
export VLLM_USE_FLASHINFER_SAMPLER=0        # flashinfer is not in the bundle
export TAPC_ATTENTION_BACKEND=TRITON_ATTN   # FlashAttention, FlashMLA and DeepGEMM binaries are not in the bundle
export PYTHONUNBUFFERED=1
export PYTHONNOUSERSITE=1
