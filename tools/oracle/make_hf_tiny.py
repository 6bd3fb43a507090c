"""A tiny random Kimi-Linear in Hugging Face form, made by transformers
(KimiLinearConfig + save_pretrained), with weights rounded to f16 so a
container with F16 experts / F32 trunk loses nothing; and transformers' own
logits for a 40-token prompt plus the greedy continuation.

    python make_hf_tiny.py OUT_DIR
"""
import json
import os
import sys

sys.modules["fla"] = None
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from kimi_linear_slice import init_weights  # noqa: E402

out = sys.argv[1]
torch.manual_seed(0)
cfg = KimiLinearConfig(
    vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None,
    qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, num_experts_per_tok=2, num_local_experts=8,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_head_dim=16, linear_num_heads=4,
    pad_token_id=None, bos_token_id=256, eos_token_id=257, routed_scaling_factor=2.446)
model = KimiLinearForCausalLM(cfg).float().eval()
# weights rounded to f16 so storage at f16 loses nothing
init_weights(model, torch, round_to=torch.half)
with torch.no_grad():
    for name, b in model.named_buffers():
        if b.is_floating_point():
            b.copy_(b.half().float())
model.save_pretrained(out)
rng = np.random.default_rng(3)
ids = [256] + rng.integers(0, 256, 39).tolist()
with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0].float().numpy()
    seq, greedy = list(ids), []
    for _ in range(8):
        nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        greedy.append(nxt)
        seq.append(nxt)
with open(os.path.join(out, "reference.json"), "w") as f:
    json.dump({"_": "transformers' KimiLinearForCausalLM logits for this directory's weights; made by tools/oracle/make_hf_tiny.py",
               "ids": ids, "logits": [[float(f"{v:.7g}") for v in r] for r in logits], "greedy": greedy}, f)
print("ok", out)
