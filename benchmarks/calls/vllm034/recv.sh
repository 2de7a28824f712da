#!/usr/bin/env bash
# Receives one part of the vLLM 0.34.0 bundle (benchmarks/calls/make-vllm034-bundle) on the GPU
# machine, one part per call, from the project root:
#     bash .gpu034/pN/recv.sh
# Each call stores its piece in /tmp/b034. The call that completes the set named in SHA256SUMS
# checks the pieces and unpacks them into /tmp/site034; a warm machine keeps /tmp for about 30 s,
# so the calls follow each other closely. Then:  source .gpu034/pK/env.sh  (K: the last part).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
B=/tmp/b034
S=/tmp/site034
if [ -f "$S/.bundle034-ok" ]; then echo "[recv034] $S is already complete"; exit 0; fi
mkdir -p "$B"
for f in "$HERE"/piece.*; do
  n=$(basename "$f")
  cp "$f" "$B/$n.tmp" && mv "$B/$n.tmp" "$B/$n"
  echo "[recv034] stored $n ($(stat -c %s "$B/$n") bytes) in $B"
done
cd "$B"
missing=""
while read -r _ name; do [ -f "$name" ] || missing="$missing $name"; done < "$HERE/SHA256SUMS"
if [ -n "$missing" ]; then
  echo "[recv034] still missing:$missing"
  # the last part (the one with env.sh) must complete the set: earlier pieces were lost with /tmp
  if [ -f "$HERE/env.sh" ]; then echo "[recv034] ERROR: pieces missing at the last part (/tmp was cleared?)"; exit 3; fi
  exit 0
fi
sha256sum -c --quiet "$HERE/SHA256SUMS" || { echo "[recv034] ERROR: checksum mismatch"; exit 4; }
echo "[recv034] all pieces present; unpacking into $S"
rm -rf "$S" && mkdir -p "$S"
t0=$(date +%s)
cat $(awk '{print $2}' "$HERE/SHA256SUMS") | xz -d -T0 | tar x -C "$S"
# torch 2.14 finds its CUDA libraries through RPATH $ORIGIN/../../nvidia/<pkg>/lib. NCCL 2.30.7 is
# carried in $S/nvidia/nccl; the image's other CUDA 13 packages (cu13, cudnn, cusparselt, nvshmem)
# are linked beside it.
for d in $(env -u PYTHONPATH python3 -c 'import importlib.util as u; s=u.find_spec("nvidia"); print("\n".join(s.submodule_search_locations) if s else "")'); do
  [ "$d" = "$S/nvidia" ] && continue
  for sub in "$d"/*/; do
    name=$(basename "$sub")
    case "$name" in nccl|__pycache__) continue ;; esac
    [ -e "$S/nvidia/$name" ] || ln -s "${sub%/}" "$S/nvidia/$name"
  done
done
touch "$S/.bundle034-ok"
rm -rf "$B"
echo "[recv034] unpacked in $(( $(date +%s) - t0 )) s: $(du -sh "$S" | cut -f1); nvidia/: $(ls "$S/nvidia" | tr '\n' ' ')"
