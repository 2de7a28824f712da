#!/usr/bin/env bash
# One benchmark run on a GPU machine: one of benchmarks/*.py with its flags, run from the project
# root with the GPU bundle (.gpu-serve, built as suite.sh says), e.g.
#     bash benchmarks/calls/bench.sh bench_moe.py --phases moe --repeats 5 --generate 512 --out "$OUT/moe.md"
#     bash benchmarks/calls/bench.sh profile_step.py --shape moe --generate 512 --out "$OUT/profile.md"
# Its output goes to $OUT/<script>.log (unbuffered: a run cut short keeps what was printed),
# cut at ${LIMIT:-560} s so that a run with a 600 s limit still returns its log; the end is printed.
# BUNDLE names another bundle folder, e.g. one without the MoE kernels that has room for a peer:
#     TAPC_GPU_EXTRA="nnsight==0.8.1 greenlet" bash ../shared/gpu/make-bundle .gpu-trace
#     BUNDLE=.gpu-trace bash benchmarks/calls/bench.sh bench_tracing.py
# `{LOG}` in a flag becomes the run's name (ab.sh's runs write apart: --out "$OUT/moe-{LOG}.md").
script=$1; shift
name=${LOG:-${script%.py}}
set -- "${@//\{LOG\}/$name}"
# the bundle installs afresh (a warm machine may hold another's), unless KEEP_SITE=1: a machine
# that holds this bundle and Ray's (benchmarks/calls/make-ray-bundle, installed by an earlier run;
# /tmp/site is on PYTHONPATH, so `import ray` finds it)
[ "${KEEP_SITE:-0}" = 1 ] || rm -rf /tmp/site
export VLLM_DISABLE_COMPILE_CACHE=1
source "${BUNDLE:-.gpu-serve}/activate"
out=${OUT:-/tmp/out}; mkdir -p "$out"
log="$out/$name.log"   # LOG: another name, for a second run on the same machine
env | grep '^TAPC_' > "$log"   # the tapc settings of this run (ab.sh), if any
timeout "${LIMIT:-560}" python3 -u "benchmarks/$script" "$@" >> "$log" 2>&1
echo "rc=$?" >> "$log"
tail -40 "$log"
