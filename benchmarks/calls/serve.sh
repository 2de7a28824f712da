#!/usr/bin/env bash
# bench_serve on an 8B-sized body (Llama-3.1-8B's widths and depth, vLLM's dummy weights on both
# servers, capturing requests asking for one layer as an SAE harvest does), the load of the
# served figures since 2026-12-01 (benchmarks/results/bench_serve-h200.md). Flags after
# the script's name go to bench_serve (mixes, rounds, --timers, --profile, --kernels), e.g.
#     bash benchmarks/calls/serve.sh --rounds 2 --mix 1,0,0,0 0.4,0.2,0.25,0.15 --timers "$OUT/timers.md"
# Each server starts in 100-150 s (more where the Triton cache is empty) and a round of a mix is
# two loads of 10-15 s: 600 s hold about six rounds after the starts. The log
# ($OUT/bench_serve.log) has a progress line with the seconds since start for each phase, so a
# run cut short by its limit shows how far it got. ab.sh runs it twice, to measure a tapc
# setting against the default on the same machine.
exec bash "$(dirname "$0")/bench.sh" bench_serve.py --hidden 4096 --layers 32 --dummy-weights --check-rounds 0 \
    --requests 700 --via shm --prefix-rows-gib 4 --capture model.layers.16.resid --out "${OUT:-/tmp/out}/${LOG:-serve}.md" "$@"
