"""The fixture of the `fast` numeric mode's quality contract (issue 50): a
random Kimi-Linear made by transformers at the size the issue estimated
with (hidden 256, 16 experts top-4, 4 layers; KDA and MLA layers, a dense
first layer), its float32 logits over 256 teacher-forced positions (72 until the
fast mode took the VQ experts too: one position was then 1.4 points of
top-1 agreement, more than the contract's 1-point margin), and its
conversion by `waste convert` with VQ3R experts and a Q4 trunk (Q8 head) —
the container the test compares in both modes against these logits.

    python make_fast_quality.py WASTE_BINARY OUT_DIR

Writes OUT_DIR/model.waste/ (the converted container) and
OUT_DIR/reference.json; the Hugging Face checkpoint itself (9 MB) stays in
a temporary directory: the test needs only what the engine reads.
Run with the oracle venv (../shared/tools/oracle-venv).
"""
import json
import os
import subprocess
import sys
import tempfile

sys.modules["fla"] = None
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from kimi_linear_slice import init_weights  # noqa: E402

waste, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
torch.manual_seed(5)
cfg = KimiLinearConfig(
    vocab_size=300, hidden_size=256, intermediate_size=384, moe_intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, kv_lora_rank=64, q_lora_rank=None,
    qk_rope_head_dim=16, v_head_dim=64, qk_nope_head_dim=48, num_experts_per_tok=4, num_local_experts=16,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_head_dim=64, linear_num_heads=4,
    pad_token_id=None, bos_token_id=256, eos_token_id=257, routed_scaling_factor=2.446)
model = KimiLinearForCausalLM(cfg).float().eval()
# bf16-representable, so the checkpoint can be stored in bf16 losslessly
init_weights(model, torch, round_to=torch.bfloat16)
rng = np.random.default_rng(11)
ids = [256] + rng.integers(0, 256, 255).tolist()
with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0].float().numpy()
with tempfile.TemporaryDirectory() as hf:
    model.to(torch.bfloat16).save_pretrained(hf)
    dst = os.path.join(out, "model.waste")
    subprocess.run([waste, "convert", "--src", hf, "--out", dst, "--experts", "vq3r", "--trunk", "q4", "-q"], check=True)
with open(os.path.join(out, "reference.json"), "w") as f:
    json.dump({"_": "transformers' float32 KimiLinearForCausalLM logits of the checkpoint model.waste was converted from "
                    "(VQ3R experts, Q4 trunk); made by tools/oracle/make_fast_quality.py",
               "transformers": __import__("transformers").__version__, "torch": torch.__version__,
               "ids": ids, "logits": [[float(f"{v:.7g}") for v in r] for r in logits]}, f)
print("ok", out)
