#!/usr/bin/env bash
# One GPU call: one of benchmarks/*.py with its flags, run from the project root with the GPU
# bundle (.gpu-serve, built as suite.sh says and sent along in the device tool's carry), e.g.
#     bash benchmarks/calls/bench.sh bench_moe.py --phases moe --repeats 5 --generate 512 --out "$OUT/moe.md"
#     bash benchmarks/calls/bench.sh profile_step.py --shape moe --generate 512 --out "$OUT/profile.md"
# Its output goes to $OUT/<script>.log (unbuffered: a call cut short keeps what was printed),
# cut at ${LIMIT:-560} s so that the log comes back inside a 600 s call; the end is printed.
# `{LOG}` in a flag becomes the run's name (ab.sh's runs write apart: --out "$OUT/moe-{LOG}.md").
script=$1; shift
name=${LOG:-${script%.py}}
set -- "${@//\{LOG\}/$name}"
rm -rf /tmp/site   # the bundle installs afresh: a warm machine may hold another's
export VLLM_DISABLE_COMPILE_CACHE=1
source .gpu-serve/activate
out=${OUT:-/tmp/out}; mkdir -p "$out"
log="$out/$name.log"   # LOG: another name, for a second run in the same call
env | grep '^TAPC_' > "$log"   # the tapc settings of this run (ab.sh), if any
timeout "${LIMIT:-560}" python3 -u "benchmarks/$script" "$@" >> "$log" 2>&1
echo "rc=$?" >> "$log"
tail -40 "$log"
