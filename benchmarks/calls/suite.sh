#!/usr/bin/env bash
# One GPU call: the whole GPU suite, on one H200 460-520 s from a cold start. From the project
# root, with the bundle built here (TAPC_GPU_MOE=1 bash ../shared/gpu/make-bundle .gpu-serve,
# plus TAPC_GPU_EXTRA as README says) and sent along (the device tool's carry: .gpu-serve):
#     bash benchmarks/calls/suite.sh
# The log goes to $OUT/suite.log; its last lines are printed.
rm -rf /tmp/site   # the bundle installs afresh: a warm machine may hold another's
export VLLM_DISABLE_COMPILE_CACHE=1
source .gpu-serve/activate
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi > "$out/smi.txt" 2>&1
timeout "${LIMIT:-560}" python3 -m pytest -m gpu tests -n 6 --dist loadgroup -q -p no:cacheprovider > "$out/suite.log" 2>&1
echo "rc=$?" >> "$out/suite.log"
tail -30 "$out/suite.log"
