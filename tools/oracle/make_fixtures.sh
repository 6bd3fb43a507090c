#!/usr/bin/env bash
# Regenerate the oracle fixtures: four tiny synthetic containers of different
# shapes and expert formats, and transformers' logits for each.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=$(../shared/tools/oracle-venv)/bin/python
F=tools/oracle/fixtures
mkdir -p $F
# synth writes only into an empty folder or one it made: these are ours, start afresh
rm -rf $F/tiny.waste $F/tiny-b.waste $F/tiny-c.waste $F/tiny-q4g.waste $F/tiny-k3.waste $F/tiny-k3-4.waste
cargo xtask synth --shape tiny   --seed 11 --experts vq3r --out $F/tiny.waste
cargo xtask synth --shape tiny-b --seed 12 --experts vq4p --out $F/tiny-b.waste
cargo xtask synth --shape tiny-c --seed 13 --experts f16  --out $F/tiny-c.waste
cargo xtask synth --shape tiny   --seed 14 --experts q4g  --out $F/tiny-q4g.waste
rm -f $F/*.waste/.waste-synth
for s in tiny tiny-b tiny-c tiny-q4g; do
  $PY tools/oracle/kimi_linear_oracle.py $F/$s.waste $F/$s.logits.json --seed 5 --len 40
done
# Kimi K3: component fixtures and two tiny K3-shaped containers (AttnRes block 2
# not dividing 5 layers, and dividing 4), both with latent MoE, SiTU, 2 shared
# experts, q-LoRA, output gates, a KDA/MLA mix.
cargo xtask synth --shape tiny-k3 --seed 21 --experts vq3r --out $F/tiny-k3.waste
cargo xtask synth --shape tiny-k3 --seed 22 --experts f16 --layers 4 --out $F/tiny-k3-4.waste
rm -f $F/*.waste/.waste-synth
$PY tools/oracle/k3_oracle.py components $F/k3-components.json
for s in tiny-k3 tiny-k3-4; do
  $PY tools/oracle/k3_oracle.py model $F/$s.waste $F/$s.logits.json --len 36
done
# Converter: a tiny HF-form Kimi-Linear made by transformers + its logits; MXFP4 decoding.
rm -rf $F/hf-tiny
$PY tools/oracle/make_hf_tiny.py $F/hf-tiny
$PY tools/oracle/mxfp4.py $F/mxfp4.json
# Kimi K3 with a vision tower in the release's HF form, converted (F16 experts,
# F32 text trunk, Q8G tower: the engine's default), and the PyTorch vision
# oracle over it: two PNGs, their embeddings, a prompt holding both.
rm -rf $F/hf-k3-vision $F/k3-vision /tmp/waste-k3-vision.waste
$PY tools/oracle/make_hf_k3.py $F/tiny-k3.waste $F/hf-k3-vision --vision
cargo run --release -q -p waste-cli -- convert --src $F/hf-k3-vision --out /tmp/waste-k3-vision.waste --experts f16 --trunk f32 -q
$PY tools/oracle/k3_oracle.py vision /tmp/waste-k3-vision.waste $F/k3-vision
rm -rf /tmp/waste-k3-vision.waste
# Kimi K3 in the release's HF form (MXFP4 experts) + llama.cpp's kimi-k3 logits.
# Needs llama.cpp's source (the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp,
# LLAMA_CPP_SRC) and that llama-cpp-python installed in the oracle venv.
if [ -n "${LLAMA_CPP_SRC:-}" ]; then
  rm -rf $F/hf-k3
  $PY tools/oracle/make_hf_k3.py $F/tiny-k3.waste $F/hf-k3
  $PY tools/oracle/llama_k3.py "$LLAMA_CPP_SRC" $F/hf-k3 $F/hf-k3/llama-cpp.json --len 32 --greedy 8
else
  echo "LLAMA_CPP_SRC not set: hf-k3 (llama.cpp cross-check) not regenerated" >&2
fi
