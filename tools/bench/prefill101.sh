#!/usr/bin/env bash
# Prefill of a 101-token prompt, two binaries alternated (issue 12's
# "≥ 3× the starting commit"): each round runs A then B with a cold cache
# (fresh process), then A then B with every expert preloaded from USAGE.
#
#   tools/bench/prefill101.sh A_BIN B_BIN CONTAINER USAGE [ROUNDS]
#
# CONTAINER: e.g. `cargo xtask synth --shape kimi-linear-48b --layers 4
# --seed 1 --out /tmp/k48s4.waste`; USAGE: a hotlist naming every expert
# (FORMAT.md "usage.waste"; tools/bench/llama_parity.py writes one).
# Prints one line per run: prefill and decode ms/token and, where the
# binary reports it, the prefill split.
set -euo pipefail
A=$1 B=$2 MODEL=$3 USAGE=$4 ROUNDS=${5:-3}
for i in $(seq "$ROUNDS"); do
  for mode in cold preloaded; do
    for bin in A B; do
      exe=${!bin}
      extra=()
      [ "$mode" = preloaded ] && extra=(--usage "$USAGE")
      "$exe" bench "$MODEL" --budget 8G --prompt-len 101 -n 8 --json "${extra[@]}" 2>/dev/null |
        python3 -c "
import json, sys
v = json.load(sys.stdin)
p = v.get('prefill_ms_per_token') or 1e3 * v['prefill_seconds'] / v['prefill_tokens']
split = ' '.join(f'{k[8:-13]} {v[k]:.1f}' for k in ('prefill_expert_ms_per_token', 'prefill_attention_ms_per_token',
                 'prefill_trunk_ms_per_token', 'prefill_io_wait_ms_per_token') if k in v)
print(f'$i $mode $bin prefill {p:.1f} ms/token, decode {v.get(\"ms_per_token\", 0):.1f}; {split}')"
    done
  done
done
