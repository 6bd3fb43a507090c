"""The tiny HF oracle's fixture of the fast mode's quality contract (issue
50): transformers' float32 logits of fixtures/hf-tiny (the Kimi-Linear
oracle configuration: hidden 64, 4 layers) over 256 teacher-forced ids, and
its conversion with VQ3R experts and a Q4 trunk.

    python make_fast_quality_tiny.py WASTE_BINARY OUT_DIR

Writes OUT_DIR/model.waste/ and OUT_DIR/{ids.json, logits.f32} (the format
`waste_model::quality::read_reference` reads). Run with the oracle venv
(../shared/tools/oracle-venv).
"""
import json
import os
import subprocess
import sys

sys.modules["fla"] = None
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import KimiLinearForCausalLM  # noqa: E402

waste, out = sys.argv[1], sys.argv[2]
src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf-tiny")
os.makedirs(out, exist_ok=True)
m = KimiLinearForCausalLM.from_pretrained(src, torch_dtype=torch.float32).eval()
rng = np.random.default_rng(11)
ids = [m.config.bos_token_id or 0] + rng.integers(0, min(256, m.config.vocab_size), 255).tolist()
with torch.no_grad():
    logits = m(torch.tensor([ids])).logits[0].float().numpy()
with open(os.path.join(out, "ids.json"), "w") as f:
    json.dump(ids, f)
logits.astype("<f4").tofile(os.path.join(out, "logits.f32"))
subprocess.run([waste, "convert", "--src", src, "--out", os.path.join(out, "model.waste"), "--experts", "vq3r",
                "--trunk", "q4", "-q"], check=True)
print("ok", out)
