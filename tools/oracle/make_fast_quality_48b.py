"""The fast numeric mode's quality contract on the Kimi-Linear-48B shape
(issue 50): a slice of its first LAYERS layers (hidden 2304, 256 experts
top-8, KDA 32x128, MLA 32 heads, vocabulary 163840; the last layer MLA
when the slice does not reach the 4th, as tools/bench/llama_parity.py
builds it) made by transformers with random bf16 weights drawn as
make_fast_quality.py draws them (normal, 1/sqrt(fan_in); the router 4x,
so routing is not uniform), transformers' float32 logits over POSITIONS
teacher-forced ids, and `waste convert --experts vq3r --trunk q4` of it.

    python make_fast_quality_48b.py WASTE_BINARY WORK [--layers 3] [--positions 256]

Writes WORK/hf/ (the checkpoint, about 9 GB), WORK/slice.waste (the
container), WORK/reference/{ids.json, logits.f32}, then runs
`cargo run --release -p waste-model --example fast_quality -- WORK/slice.waste WORK/reference`
yourself (or with --measure, here). Peak memory about 19 GB: the model is
made in bf16 and turned to float32 parameter by parameter for the forward.
Run with the oracle venv (../shared/tools/oracle-venv).
"""
import argparse
import json
import os
import subprocess
import sys

ap = argparse.ArgumentParser()
ap.add_argument("waste")
ap.add_argument("work")
ap.add_argument("--layers", type=int, default=3)
ap.add_argument("--positions", type=int, default=256)
ap.add_argument("--measure", action="store_true", help="run the Rust example on the result")
a = ap.parse_args()
os.makedirs(a.work, exist_ok=True)
hf = os.path.join(a.work, "hf")
ref = os.path.join(a.work, "reference")
container = os.path.join(a.work, "slice.waste")

sys.modules["fla"] = None
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from kimi_linear_slice import init_weights, rename_dense, slice_48b_config  # noqa: E402


def log(*x):
    print(*x, file=sys.stderr, flush=True)


cfg = slice_48b_config(KimiLinearConfig, a.layers)
torch.manual_seed(5)
torch.set_default_dtype(torch.bfloat16)
model = KimiLinearForCausalLM(cfg).eval()
init_weights(model, torch)
log("initialised; saving")
model.save_pretrained(hf, max_shard_size="2GB")
rename_dense(hf)
log("float32 forward")
model = model.float()
torch.set_default_dtype(torch.float32)
rng = np.random.default_rng(11)
ids = [163584] + rng.integers(0, 163584, a.positions - 1).tolist()
with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0].float().numpy()
del model
os.makedirs(ref, exist_ok=True)
with open(os.path.join(ref, "ids.json"), "w") as fh:
    json.dump(ids, fh)
logits.astype("<f4").tofile(os.path.join(ref, "logits.f32"))
with open(os.path.join(ref, "README"), "w") as fh:
    fh.write(f"transformers {__import__('transformers').__version__} float32 logits of {hf}, "
             f"made by tools/oracle/make_fast_quality_48b.py\n")
log("converting")
subprocess.run([a.waste, "convert", "--src", hf, "--out", container, "--experts", "vq3r", "--trunk", "q4", "-q"],
               check=True)
if a.measure:
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run(["cargo", "run", "--release", "-q", "-p", "waste-model", "--example", "fast_quality", "--",
                    container, ref], check=True, cwd=os.path.join(here, "..", ".."))
print("ok", a.work)
