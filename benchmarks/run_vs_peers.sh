#!/usr/bin/env bash
# Run colls (tcp, shared memory on and off), torch Gloo and MPICH (shared memory on and off)
# side by side: REPEATS rounds, each running every implementation at N=2 and N=4 in turn (so slow
# drifts of a shared host spread over all rows alike), then startup launches, then the report.
#   PY=/path/to/venv/bin/python REPEATS=3 OUT=results bash benchmarks/run_vs_peers.sh
set -euo pipefail
cd "$(dirname "$0")"
P=${PY:-python3}
R=${REPEATS:-3}
OUT=${OUT:-results}
QUIET=${QUIET_WAIT:-60}
IMPLS=${IMPLS:-"colls colls-tcp gloo mpi mpi-tcp"}
mkdir -p "$OUT"
B="$P bench_vs_peers.py"
for rep in $(seq 1 "$R"); do
  echo "=== repeat $rep / $R  $(date +%T)  load $(cut -d' ' -f1-3 /proc/loadavg)"
  for n in 2 4; do
    for impl in $IMPLS; do
      $B bench --impl "$impl" -n "$n" --quiet-wait "$QUIET" --out "$OUT/bench.jsonl" \
        || echo "=== FAILED: $impl n=$n (see above); going on"
    done
  done
done
echo "=== startup $(date +%T)"
for impl in colls gloo mpi; do
  $B startup --impl "$impl" -n 4 --repeats 5 --out "$OUT/startup.jsonl" \
    || echo "=== FAILED: startup $impl (see above); going on"
done
echo "=== done $(date +%T)"
$B report "$OUT/bench.jsonl" "$OUT/startup.jsonl" > "$OUT/report.md"
cat "$OUT/report.md"
