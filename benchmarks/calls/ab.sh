#!/usr/bin/env bash
# An A/B on one GPU machine: a tapc setting (an environment variable of the engine's processes)
# against the default, each as a ratio to vanilla on the same machine, since vanilla's own step
# time differs by up to a third between machines of one kind (benchmarks/results/bench_serve-h200.md).
# Runs `bench.sh SCRIPT ...` (or a script of this folder, e.g. serve.sh) twice, the second with
# NAME=VALUE exported, e.g.
#     bash benchmarks/calls/ab.sh TAPC_SWITCH_GRAPHS=0 serve.sh --rounds 2 --mix 0.4,0.2,0.25,0.15 \
#         --timers "$OUT/timers-{LOG}.md"
#     bash benchmarks/calls/ab.sh TAPC_SWITCH_GRAPHS=0 bench.sh bench_moe.py --phases moe --batches 1 --repeats 4
# The logs (and serve.sh's tables) are named default and setting under $OUT, as is `{LOG}` in a
# flag (bench.sh); each run is cut at LIMIT_A / LIMIT_B seconds. The first run starts the
# machine's first engines: a serve.sh run's servers took 264 s to start on a machine with empty
# caches (2026-12-02, one H200) and about 185 s after; two rounds take 40-50 s more.
setting=$1 call=$2; shift 2
here=$(dirname "$0")
LIMIT=${LIMIT_A:-325} LOG=default bash "$here/$call" "$@"
env "$setting" LIMIT="${LIMIT_B:-250}" LOG=setting bash "$here/$call" "$@"
