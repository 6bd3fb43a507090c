"""Reference logits for a Kimi-Linear container, computed by transformers.

Reads the container with `container.py` (independent numpy decoding of
every format), loads the weights into transformers' KimiLinearForCausalLM
(pure-PyTorch KDA: the fla import is blocked), and writes the logits of every
position of a prompt plus the greedy continuation.

    python tools/oracle/kimi_linear_oracle.py CONTAINER OUT.json [--seed S] [--len N]

Regenerate the committed fixtures with tools/oracle/make_fixtures.sh.
"""
import argparse
import json
import sys

sys.modules["fla"] = None  # transformers would switch KDA to fla's GPU kernels

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from container import Container  # noqa: E402


def hf_config(c):
    n = c["num_hidden_layers"]
    lin = c.get("linear_attn_config") or {}
    full = set(lin.get("full_attn_layers") or [])
    layer_types = ["full_attention" if (i + 1) in full else "linear_attention" for i in range(n)]
    k = c.get("first_k_dense_replace", 0)
    return KimiLinearConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c.get("intermediate_size") or 1,
        moe_intermediate_size=c["moe_intermediate_size"], num_hidden_layers=n,
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_attention_heads"],
        n_shared_experts=c.get("num_shared_experts", 0), routed_scaling_factor=c.get("routed_scaling_factor", 1.0),
        kv_lora_rank=c["kv_lora_rank"], q_lora_rank=c.get("q_lora_rank"), qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"], qk_nope_head_dim=c["qk_nope_head_dim"], n_group=c.get("num_expert_group", 1),
        topk_group=c.get("topk_group", 1), num_experts_per_tok=c["num_experts_per_token"],
        norm_topk_prob=c.get("moe_renormalize", True), rms_norm_eps=c["rms_norm_eps"],
        num_local_experts=c["num_experts"], layer_types=layer_types,
        mlp_layer_types=["dense" if i < k else "sparse" for i in range(n)],
        linear_head_dim=lin["head_dim"], linear_num_heads=lin["num_heads"],
        linear_conv_kernel_dim=lin.get("short_conv_kernel_size", 4),
        pad_token_id=None, bos_token_id=c.get("bos_token_id"), eos_token_id=c.get("eos_token_id"),
        tie_word_embeddings=c.get("tie_word_embeddings", False),
    )


def state_dict(ct, cfg):
    t = lambda n: torch.from_numpy(ct.tensor(n))  # noqa: E731
    sd = {"model.embed_tokens.weight": t("model.embed_tokens.weight"), "model.norm.weight": t("model.norm.weight"),
          "lm_head.weight": t("lm_head.weight")}
    c = ct.config
    for L in range(cfg.num_hidden_layers):
        p = f"model.layers.{L}."
        a = p + "self_attn."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            sd[p + n] = t(p + n)
        if cfg.layer_types[L] == "linear_attention":
            for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
                sd[a + n + ".weight"] = t(a + n + ".weight")
            sd[a + "o_norm.weight"] = t(a + "o_norm.weight")
            convs = [t(a + f"{x}_conv1d.weight").reshape(-1, 1, cfg.linear_conv_kernel_dim) for x in "qkv"]
            sd[a + "conv1d.weight"] = torch.cat(convs, 0)
            sd[a + "forget_gate.f_a_proj.weight"] = t(a + "f_a_proj.weight")
            sd[a + "forget_gate.f_b_proj.weight"] = t(a + "f_b_proj.weight")
            sd[a + "forget_gate.dt_bias"] = t(a + "dt_bias").reshape(-1)
            sd[a + "forget_gate.A_log"] = t(a + "A_log").reshape(-1)[: cfg.linear_num_heads].reshape(1, 1, -1, 1)
        else:
            names = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
            names += ["q_a_proj", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"]
            for n in names:
                sd[a + n + ".weight"] = t(a + n + ".weight")
            sd[a + "kv_a_layernorm.weight"] = t(a + "kv_a_layernorm.weight")
            if cfg.q_lora_rank:
                sd[a + "q_a_layernorm.weight"] = t(a + "q_a_layernorm.weight")
        if cfg.mlp_layer_types[L] == "dense":
            for n in ("gate_proj", "up_proj", "down_proj"):
                sd[p + f"mlp.{n}.weight"] = t(p + f"mlp.{n}.weight")
        else:
            m = p + "block_sparse_moe."
            sd[p + "mlp.gate.weight"] = t(m + "gate.weight")
            sd[p + "mlp.gate.e_score_correction_bias"] = t(m + "gate.e_score_correction_bias")
            gu, dn = [], []
            for e in range(c["num_experts"]):
                w1, w3, w2 = ct.expert(L, e)
                gu.append(np.concatenate([w1, w3], 0))
                dn.append(w2)
            sd[p + "mlp.experts.gate_up_proj"] = torch.from_numpy(np.stack(gu))
            sd[p + "mlp.experts.down_proj"] = torch.from_numpy(np.stack(dn))
            for n in ("gate_proj", "up_proj", "down_proj"):
                key = m + f"shared_experts.{n}.weight"
                if ct.prefix + key in ct.index:
                    sd[p + f"mlp.shared_experts.{n}.weight"] = t(key)
    return sd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("container")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--len", type=int, default=40)
    ap.add_argument("--greedy", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    ct = Container(args.container)
    cfg = hf_config(ct.config)
    model = KimiLinearForCausalLM(cfg).float().eval()
    sd = state_dict(ct, cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "shared_experts" not in k or ct.config.get("num_shared_experts", 0) > 0]
    assert not missing and not unexpected, (missing, unexpected)
    rng = np.random.default_rng(args.seed)
    bos = ct.config.get("bos_token_id", 0)
    ids = [bos] + rng.integers(0, min(256, cfg.vocab_size), args.len - 1).tolist()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
        seq = list(ids)
        greedy = []
        for _ in range(args.greedy):
            nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            greedy.append(nxt)
            seq.append(nxt)
    out = {"_": "reference logits from transformers' KimiLinearForCausalLM on weights decoded by tools/oracle/container.py; made by tools/oracle/kimi_linear_oracle.py",
           "transformers": __import__("transformers").__version__, "torch": torch.__version__,
           "ids": ids, "logits": [[float(f"{v:.7g}") for v in row] for row in logits], "greedy": greedy}
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
