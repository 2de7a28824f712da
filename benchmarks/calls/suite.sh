#!/usr/bin/env bash
# The whole GPU suite: on one H100 454 s on a warm machine, more than 560 s on a fresh one (every
# kernel compiled afresh). Extra arguments go to pytest. From the project root, with
# the bundle every script here uses (MoE kernels, what `vllm serve` needs beyond the bundle,
# pytest-xdist; docs/internals/testing.md) in .gpu-serve:
#     TAPC_GPU_MOE=1 TAPC_GPU_EXTRA="uvicorn click h11 watchfiles model-hosting-container-standards \
#         jmespath prometheus-fastapi-instrumentator pytest-xdist execnet" bash ../shared/gpu/make-bundle .gpu-serve
#     bash benchmarks/calls/suite.sh          (on the GPU machine)
# The log goes to $OUT/suite.log; its last lines are printed.
# the bundle installs afresh (a warm machine may hold another's), unless KEEP_SITE=1: a machine
# that holds this bundle and Ray's (benchmarks/calls/make-ray-bundle, installed by an earlier run;
# /tmp/site is on PYTHONPATH, so `import ray` finds it)
[ "${KEEP_SITE:-0}" = 1 ] || rm -rf /tmp/site
export VLLM_DISABLE_COMPILE_CACHE=1
source .gpu-serve/activate
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi > "$out/smi.txt" 2>&1
# SIGINT at the limit, so that pytest still prints which tests had not finished
timeout -s INT -k 15 "${LIMIT:-560}" python3 -m pytest -m gpu tests -n 6 --dist loadgroup -q -p no:cacheprovider \
    --durations=15 "$@" > "$out/suite.log" 2>&1
echo "rc=$?" >> "$out/suite.log"
tail -30 "$out/suite.log"
