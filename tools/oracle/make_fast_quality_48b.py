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
import struct
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


def log(*x):
    print(*x, file=sys.stderr, flush=True)


def layer_types(n):
    t = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    if "full_attention" not in t:
        t[-1] = "full_attention"
    return t


def dense_name(k):
    return k.replace("model.layers.0.block_sparse_moe.", "model.layers.0.mlp.")


def rename_in_shard(path):
    """Rename the layer-0 dense FFN (transformers saves block_sparse_moe.*,
    the release and the converter say mlp.*) in a safetensors header."""
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        head = json.loads(fh.read(n))
        if not any(dense_name(k) != k for k in head):
            return
        new = json.dumps({dense_name(k): v for k, v in head.items()}, separators=(",", ":")).encode()
        new += b" " * (-len(new) % 8)
        tmp = path + ".tmp"
        with open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(new)))
            out.write(new)
            while True:
                b = fh.read(1 << 24)
                if not b:
                    break
                out.write(b)
    os.replace(tmp, path)


n = a.layers
cfg = KimiLinearConfig(
    vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=n,
    num_attention_heads=32, num_key_value_heads=32, n_shared_experts=1, kv_lora_rank=512, q_lora_rank=None,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, num_experts_per_tok=8, num_local_experts=256,
    layer_types=layer_types(n), mlp_layer_types=["dense"] + ["sparse"] * (n - 1), linear_head_dim=128,
    linear_num_heads=32, pad_token_id=None, bos_token_id=163584, eos_token_id=163586, routed_scaling_factor=2.446)
torch.manual_seed(5)
torch.set_default_dtype(torch.bfloat16)
model = KimiLinearForCausalLM(cfg).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, (4.0 if name.endswith("mlp.gate.weight") else 1.0) / p.shape[-1] ** 0.5)
        elif "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif name.endswith("e_score_correction_bias"):
            p.copy_(0.05 * torch.randn_like(p))
        elif name.endswith("dt_bias"):
            p.copy_(0.5 * torch.randn_like(p))
log("initialised; saving")
model.save_pretrained(hf, max_shard_size="2GB")
for f in sorted(os.listdir(hf)):
    if f.endswith(".safetensors"):
        rename_in_shard(os.path.join(hf, f))
idx = os.path.join(hf, "model.safetensors.index.json")
if os.path.exists(idx):
    with open(idx) as fh:
        j = json.load(fh)
    j["weight_map"] = {dense_name(k): v for k, v in j["weight_map"].items()}
    with open(idx, "w") as fh:
        json.dump(j, fh)
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
