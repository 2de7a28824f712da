#!/usr/bin/env bash
# One GPU call: a tapc setting (an environment variable of the engine's processes) against the
# default, each as a ratio to vanilla in the same call: vanilla's own step time differed by a
# third between two calls of one day (docs/serving.md). Runs `bench.sh SCRIPT ...` (or a script
# of this folder, e.g. serve.sh) twice, the second with NAME=VALUE exported, e.g.
#     bash benchmarks/calls/ab.sh TAPC_SWITCH_GRAPHS=0 serve.sh --rounds 2 --mix 0.4,0.2,0.25,0.15 \
#         --timers "$OUT/timers-{LOG}.md"
#     bash benchmarks/calls/ab.sh TAPC_SWITCH_GRAPHS=0 bench.sh bench_moe.py --phases moe --batches 1 --repeats 4
# (third session of 2026-12-02: TAPC_STREAM_CALLS=driver, since taken out, read 0.823x against
# the default's 1.014x in one such call.)
# The logs (and serve.sh's tables) are named default and setting under $OUT, as is `{LOG}` in a
# flag (bench.sh); each run is cut at
# LIMIT_A / LIMIT_B seconds. The first run starts the machine's first engines: a serve.sh run
# took 264 s to its servers' start on a fresh machine (fifth session of 2026-12-02, where 290 s
# held one round) and about 185 s on the same machine after; two rounds take 40-50 s more.
setting=$1 call=$2; shift 2
here=$(dirname "$0")
LIMIT=${LIMIT_A:-325} LOG=default bash "$here/$call" "$@"
env "$setting" LIMIT="${LIMIT_B:-250}" LOG=setting bash "$here/$call" "$@"
