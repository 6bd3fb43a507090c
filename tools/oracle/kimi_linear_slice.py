"""Random Kimi-Linear checkpoints made by transformers, shared by the oracle
fixture scripts (make_hf_tiny.py, make_fast_quality*.py) and
tools/bench/llama_parity.py: the weight draw the fixtures use, the
Kimi-Linear-48B slice's config, and the layer-0 dense FFN's rename.
"""
import json
import os
import struct


def init_weights(model, torch, round_to=None):
    """Draw `model`'s parameters in place: matrices normal with std
    1/sqrt(fan_in) (unit-ish activations), the routers 4x sharper (enough to
    avoid near-ties, not so much that the sigmoid saturates to exact ties),
    norms 1 + 0.1 N, correction biases 0.05 N, dt biases 0.5 N; each rounded
    through `round_to` (a torch dtype) when given, so storing the checkpoint
    at that dtype loses nothing."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p.shape[-1]
                p.normal_(0.0, (4.0 if name.endswith("mlp.gate.weight") else 1.0) / fan_in ** 0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            if round_to is not None:
                p.copy_(p.to(round_to).float())


def layer_types_48b(n):
    """The 48B layout (MLA at every 4th layer) for the first n layers; a
    slice too short to reach one gets MLA in its last layer, since
    llama.cpp's kimi-linear graph fails without any attention layer (its
    KV cache is then empty: GGML_ASSERT(buffer) in ggml-backend.cpp)."""
    t = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    if "full_attention" not in t:
        t[-1] = "full_attention"
    return t


def slice_48b_config(config_class, n):
    """The first n layers of the Kimi-Linear-48B shape: hidden 2304, 256
    experts top-8, KDA 32x128, MLA 32 heads, vocabulary 163840."""
    return config_class(
        vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=n,
        num_attention_heads=32, num_key_value_heads=32, n_shared_experts=1, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, num_experts_per_tok=8, num_local_experts=256,
        layer_types=layer_types_48b(n), mlp_layer_types=["dense"] + ["sparse"] * (n - 1), linear_head_dim=128,
        linear_num_heads=32, pad_token_id=None, bos_token_id=163584, eos_token_id=163586, routed_scaling_factor=2.446)


def dense_name(k):
    return k.replace("model.layers.0.block_sparse_moe.", "model.layers.0.mlp.")


def rename_in_shard(path):
    """Rename tensors in a safetensors header (the data section is unchanged)."""
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


def rename_dense(hf):
    """The dense FFN of layer 0 in a saved checkpoint: transformers saves
    block_sparse_moe.{gate,up,down}_proj, the release (and the converters)
    say mlp.*; every shard's header and the index are renamed."""
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
