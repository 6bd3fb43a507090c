"""A tiny Kimi K3 in the release's Hugging Face form, for the llama.cpp
cross-check: `KimiK3ForConditionalGeneration` with the text model's config
under `text_config`, tensors under the `language_model.` prefix with the
release's names, trunk in bf16, routed experts in compressed-tensors MXFP4
(`weight_packed` E2M1 nibbles, low first, + `weight_scale` E8M0 per 32).

    python make_hf_k3.py SOURCE_CONTAINER OUT_DIR [--vision]

With --vision the model also carries a tiny random vision tower and projector
under the release's names (`vision_tower.*`, `mm_projector.*`, bf16), the
release's `vision_config` and `media_placeholder_token_id` in config.json,
`media_proc_cfg` in preprocessor_config.json, and the source container's
tokenizer as `tiktoken.model` + `tokenizer_config.json` (the specials, with
the `<|media_*|>` markers). The text model's tensors are the same either way.

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
vision = "--vision" in sys.argv[3:]
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

VISION = {"vt_hidden_size": 64, "vt_num_attention_heads": 2, "qkv_hidden_size": 64, "vt_intermediate_size": 128,
          "vt_num_hidden_layers": 2, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "patch_size": 14,
          "merge_kernel_size": [2, 2], "text_hidden_size": cfg["hidden_size"], "model_type": "moonvit3d",
          "_attn_implementation": "sdpa"}
if vision:
    vr = np.random.default_rng(2027)
    d, q, ff, pw = VISION["vt_hidden_size"], VISION["qkv_hidden_size"], VISION["vt_intermediate_size"], 8
    th = cfg["hidden_size"]

    def rnd(*shape, scale):
        return vr.standard_normal(shape) * scale

    def norm(n):
        return 1.0 + 0.1 * vr.standard_normal(n)

    vt = [("vision_tower.patch_embed.proj.weight", rnd(d, 3, 14, 14, scale=588 ** -0.5)),
          ("vision_tower.patch_embed.pos_emb.weight", rnd(pw, pw, d, scale=0.5))]
    for b in range(VISION["vt_num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{b}."
        vt += [(p + "norm0.weight", norm(d)), (p + "wqkv.weight", rnd(3 * q, d, scale=d ** -0.5)),
               (p + "wo.weight", rnd(d, q, scale=q ** -0.5)), (p + "norm1.weight", norm(d)),
               (p + "mlp.fc0.weight", rnd(ff, d, scale=d ** -0.5)), (p + "mlp.fc1.weight", rnd(d, ff, scale=ff ** -0.5))]
    vt += [("vision_tower.encoder.final_layernorm.weight", norm(d)),
           ("mm_projector.proj.0.weight", rnd(4 * d, 4 * d, scale=(4 * d) ** -0.5)),
           ("mm_projector.proj.2.weight", rnd(th, 4 * d, scale=(4 * d) ** -0.5)),
           ("mm_projector.post_norm.weight", norm(th))]
    for name, a in vt:
        tensors.append((name, "BF16", list(a.shape), bf16_bytes(a)))

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
if vision:
    with open(os.path.join(src, "specials.json")) as f:
        specials = json.load(f)
    pad = next(s["id"] for s in specials if s["text"] == "<|media_pad|>")
    outer["vision_config"] = VISION
    outer["media_placeholder_token_id"] = pad
    outer["_"] = outer["_"].replace("make_hf_k3.py", "make_hf_k3.py --vision (with a vision tower)")
    proc = {"media_proc_cfg": {"in_patch_limit": 16384, "patch_size": 14, "patch_limit_on_one_side": 512,
                               "merge_kernel_size": 2, "image_mean": [0.48, 0.46, 0.41], "image_std": [0.27, 0.26, 0.28]}}
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump(proc, f, indent=1)
    with open(os.path.join(src, "tokenizer.model"), "rb") as f, open(os.path.join(out, "tiktoken.model"), "wb") as g:
        g.write(f.read())
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"added_tokens_decoder": {str(s["id"]): {"content": s["text"], "special": True} for s in specials}}, f, indent=1)
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(outer, f, indent=1)
print("ok", out, off, "bytes of tensors")
