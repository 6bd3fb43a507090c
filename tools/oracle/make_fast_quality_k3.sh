#!/usr/bin/env bash
# The K3 fixture of the fast mode's quality contract (issue 50): the tiny
# HF-form K3 of the llama.cpp cross-check (fixtures/hf-k3: hidden 128, 8
# experts top-3, 5 layers; KDA, MLA, latent MoE, SiTU, AttnRes), converted
# with VQ3R experts and a Q4 trunk (the container the test runs in both
# modes), and the float64 oracle's logits (k3_oracle.py) of the lossless
# conversion (F16 experts, F32 trunk) over 256 teacher-forced positions.
#
#   tools/oracle/make_fast_quality_k3.sh WASTE_BINARY OUT_DIR
#
# Run with the oracle venv's python on PATH or in PY (../shared/tools/oracle-venv).
set -euo pipefail
waste=$(realpath "$1"); out=$2
here=$(cd "$(dirname "$0")" && pwd)
PY=${PY:-python3}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out"
"$waste" convert --src "$here/fixtures/hf-k3" --out "$tmp/lossless.waste" --experts f16 --trunk f32 -q
"$waste" convert --src "$here/fixtures/hf-k3" --out "$tmp/model.waste" --experts vq3r --trunk q4 -q
(cd "$here" && "$PY" k3_oracle.py model "$tmp/lossless.waste" "$tmp/reference.json" --len 256)
rm -rf "$out/model.waste"
mv "$tmp/model.waste" "$out/model.waste"
mv "$tmp/reference.json" "$out/reference.json"
echo "ok $out"
