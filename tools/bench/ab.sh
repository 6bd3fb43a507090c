#!/usr/bin/env bash
# A/B of two `waste` binaries on one container, alternating runs (A B A B ...)
# so drift hits both alike. One JSON line per run on stdout:
#   {"bin": "A"|"B", "budget": "...", "run": i, "open_plus_one_s": wall seconds of
#    `waste eval --ids 1` (open + one token), "bench": <waste bench --json>}
# Usage: tools/bench/ab.sh A_BIN B_BIN MODEL "1.3G 2.9G 6.1G" RUNS [N]
# Nothing else may run meanwhile (a build beside a benchmark skews it).
# Table of the output: python3 tools/bench/ab_table.py FILE
set -euo pipefail
A=$1 B=$2 MODEL=$3 BUDGETS=$4 RUNS=$5 N=${6:-16}
for budget in $BUDGETS; do
  for run in $(seq 1 "$RUNS"); do
    for side in A B; do
      bin=$A; [ "$side" = B ] && bin=$B
      t0=$(date +%s.%N)
      "$bin" eval "$MODEL" --ids 1 --budget "$budget" >/dev/null 2>&1
      t1=$(date +%s.%N)
      bench=$("$bin" bench "$MODEL" --budget "$budget" -n "$N" --json 2>/dev/null)
      printf '{"bin":"%s","budget":"%s","run":%s,"open_plus_one_s":%s,"bench":%s}\n' \
        "$side" "$budget" "$run" "$(echo "$t1 - $t0" | bc -l)" "$bench"
    done
  done
done
