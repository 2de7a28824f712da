#!/usr/bin/env bash
# One GPU call: a tapc setting against the default, each as a ratio to vanilla in the same call
# (vanilla's own step time differed by a third between two calls of one day, docs/serving.md):
# serve.sh twice, the second with the tapc server's environment given first, e.g.
#     bash benchmarks/calls/serve_ab.sh TAPC_STREAM_CALLS=driver --rounds 2 --mix 0.4,0.2,0.25,0.15
# A cold run takes about 290 s to the end of its second round, a warm one less; the two logs
# and tables are $OUT/default.{log,md} and $OUT/setting.{log,md}.
setting=$1; shift
here=$(dirname "$0")
LIMIT=${LIMIT_A:-290} LOG=default bash "$here/serve.sh" "$@"
LIMIT=${LIMIT_B:-270} LOG=setting bash "$here/serve.sh" "$@" --tapc-env "$setting"
