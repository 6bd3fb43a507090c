"""A tiny Kimi K3 in the release's Hugging Face form, for the llama.cpp
cross-check: `KimiK3ForConditionalGeneration` with the text model's config
under `text_config`, tensors under the `language_model.` prefix with the
release's names, trunk in bf16, routed experts in compressed-tensors MXFP4
(`weight_packed` E2M1 nibbles, low first, + `weight_scale` E8M0 per 32).

    python make_hf_k3.py SOURCE_CONTAINER OUT_DIR

The trunk's values are taken from a synthetic K3-shaped container
(`cargo xtask synth --shape tiny-k3`, decoded by container.py) and rounded to
bf16; the experts are fresh random MXFP4 codes (exact in f16, so a container
with F16 experts and an F32 trunk holds this model without loss).
rms_norm_eps is 1e-6: llama.cpp's kimi-k3 graph uses rms_norm_eps as the
KDA q/k L2-norm epsilon, where fla (and WASTE) use 1e-6; with 1e-6 in the
config both sides use the same epsilon everywhere (docs/REFERENCE-DIFFERENCES.md).
"""
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from container import Container  # noqa: E402

src, out = sys.argv[1], sys.argv[2]
ct = Container(src)
cfg = {k: v for k, v in ct.config.items() if not k.startswith("_")}
cfg["rms_norm_eps"] = 1e-6
cfg["num_key_value_heads"] = cfg["num_attention_heads"]
cfg["max_position_embeddings"] = 4096
cfg["model_type"] = "kimi_linear"
cfg["architectures"] = ["KimiLinearForCausalLM"]
rng = np.random.default_rng(2026)


def bf16_bytes(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
    return u.astype(np.uint16).tobytes()


tensors = []  # (name, dtype, shape, bytes)
for t in ct.manifest["trunk"]:
    name = t["name"][len(ct.prefix):]
    a = ct.tensor(name)
    if name.endswith(".A_log"):
        a = a.reshape(-1)[: cfg["num_attention_heads"]]  # the release's A_log is [heads]
    tensors.append(("language_model." + name, "BF16", list(a.shape), bf16_bytes(a)))

m, lat = cfg["moe_intermediate_size"], cfg["routed_expert_hidden_size"]
layers_moe = range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])
for l in layers_moe:
    for e in range(cfg["num_experts"]):
        for w, (rows, cols) in (("w1", (m, lat)), ("w3", (m, lat)), ("w2", (lat, m))):
            codes = rng.integers(0, 16, size=(rows, cols), dtype=np.uint8)
            packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
            # E8M0 scales around 2^-4 (E2M1 values up to 6: weights up to ~0.4)
            scale = rng.integers(127 - 6, 127 - 2, size=(rows, cols // 32), dtype=np.uint8)
            base = f"language_model.model.layers.{l}.block_sparse_moe.experts.{e}.{w}"
            tensors.append((base + ".weight_packed", "U8", [rows, cols // 2], packed.tobytes()))
            tensors.append((base + ".weight_scale", "U8", [rows, cols // 32], scale.tobytes()))

os.makedirs(out, exist_ok=True)
header, off = {}, 0
for name, dt, shape, b in tensors:
    header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(b)]}
    off += len(b)
header["__metadata__"] = {"format": "pt"}
h = json.dumps(header, separators=(",", ":")).encode()
h += b" " * (-len(h) % 8)
with open(os.path.join(out, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(h)))
    f.write(h)
    for _, _, _, b in tensors:
        f.write(b)

quant = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
         "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                       "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True}}},
         "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*gate$", "re:.*routed_expert.*", "lm_head"]}
outer = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": cfg,
         "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "quantization_config": quant,
         "_": "tiny random Kimi K3 in the release's form; made by tools/oracle/make_hf_k3.py"}
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(outer, f, indent=1)
print("ok", out, off, "bytes of tensors")
