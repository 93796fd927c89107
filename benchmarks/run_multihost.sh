#!/usr/bin/env bash
# all_reduce across emulated hosts (network namespaces on a bridge, tbf-capped links): colls
# (two-level and flat), Gloo and MPICH side by side, then the table with the cost model's
# prediction and a plot. Needs root and iproute2 (tc). One flock'ed run per K, so each stays
# under ~10 minutes and no other benchmark runs meanwhile.
#   bash benchmarks/run_multihost.sh [OUT_DIR]      (default: multihost-results)
# Env: KS ("2 4"), LS (1,2), RATES (1gbit,10gbit), TARGET_S (1.0 s of timed iterations per size).
set -euo pipefail
cd "$(dirname "$0")"
OUT=${1:-multihost-results}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
for K in ${KS:-2 4}; do
  echo "=== K=$K $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  flock /tmp/colls-bench.lock python bench_multihost.py run --ks "$K" --ls "${LS:-1,2}" \
    --rates "${RATES:-1gbit,10gbit}" --target-s "${TARGET_S:-1.0}" --out "$OUT/multihost.jsonl"
done
echo "=== done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
python bench_multihost.py report "$OUT/multihost.jsonl" --plot "$OUT/multihost.png" \
  | tee "$OUT/multihost.md"
