"""Kimi K3 reference, written in PyTorch from ../shared/spec/MODEL.md alone
(the release's modeling code is not installable here). Two jobs:

  python k3_oracle.py components OUT.json
      random inputs and outputs for SiTU, both KDA decay gates (same inputs),
      and Attention Residuals (several blocks; the output aggregation).
  python k3_oracle.py model CONTAINER OUT.json [--len 36]
      logits at every position of a prompt for a K3-shaped container (weights
      decoded by container.py), token by token: recurrent KDA, non-absorbed MLA
      with full keys/values, latent MoE, SiTU, AttnRes.
  python k3_oracle.py vision CONTAINER OUT_DIR
      two test images (written as PNG: one whose sides are whole patches, one
      RGBA that is resampled), their patch grids, the vision tower's patch
      embedding and final image embeddings (tower + 2x2 merge + projector, from
      MODEL.md "Vision"), and the text model's logits at every position of a
      prompt holding both images, plus a greedy continuation.

Everything in float64 so the oracle's own rounding is negligible.
"""
import argparse
import json
import math
import sys

import numpy as np
import torch

from container import Container

torch.set_default_dtype(torch.float64)


def rmsnorm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def situ(g, u, beta, lbeta):
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    b = lbeta * torch.tanh(u / lbeta) if lbeta > 0 else u
    return a * b


def softplus_gate(z, a_log):
    sp = torch.where(z > 20.0, z, torch.log(1.0 + torch.exp(z)))
    return -torch.exp(a_log) * sp


def bounded_gate(z, a_log, lb):
    return lb * torch.sigmoid(torch.exp(a_log) * z)


def attn_res(blocks, p, n_w, p_w, eps):
    cands = list(blocks) + [p]
    scores = torch.stack([(v * torch.rsqrt(v.pow(2).mean() + eps) * n_w * p_w).sum() for v in cands])
    a = torch.softmax(scores, 0)
    return sum(a[i] * cands[i] for i in range(len(cands)))


def components(out):
    rng = np.random.default_rng(1)
    t = lambda *s, scale=1.0: torch.tensor(rng.standard_normal(s) * scale)  # noqa: E731
    res = {}
    g, u = t(200, scale=6.0), t(200, scale=30.0)
    res["situ"] = {"beta": 4.0, "linear_beta": 25.0, "g": g.tolist(), "u": u.tolist(), "out": situ(g, u, 4.0, 25.0).tolist(),
                   "u_small": (u / 30.0).tolist(), "out_raw_u": situ(g, u / 30.0, 4.0, 0.0).tolist()}
    z, a = t(200, scale=3.0), t(200, scale=0.5)
    res["gates"] = {"z": z.tolist(), "a_log": a.tolist(), "lower_bound": -5.0,
                    "softplus": softplus_gate(z, a).tolist(), "bounded": bounded_gate(z, a, -5.0).tolist()}
    h = 64
    blocks = [t(h, scale=2.0) for _ in range(4)]
    p, nw, pw = t(h), 1.0 + 0.1 * t(h), t(h, scale=0.5)
    res["attn_res"] = {"hidden": h, "eps": 1e-5, "blocks": [b.tolist() for b in blocks], "p": p.tolist(), "norm": nw.tolist(), "proj": pw.tolist(),
                       "out": attn_res(blocks, p, nw, pw, 1e-5).tolist(), "out_one_block": attn_res(blocks[:1], p, nw, pw, 1e-5).tolist()}
    with open(out, "w") as f:
        json.dump(res, f)


class K3:
    def __init__(self, ct):
        self.ct = ct
        c = self.c = ct.config
        self.h = c["hidden_size"]
        self.L = c["num_hidden_layers"]
        lin = c["linear_attn_config"]
        full = set(lin.get("full_attn_layers") or [])
        self.kinds = ["mla" if (i + 1) in full else "kda" for i in range(self.L)]
        self.H, self.D, self.K = lin["num_heads"], lin["head_dim"], lin.get("short_conv_kernel_size", 4)
        self.lb = lin.get("gate_lower_bound")
        self.full_gate = bool(lin.get("use_full_rank_gate", False))
        self.eps = c["rms_norm_eps"]
        act = c.get("hidden_act", "silu")
        self.act = (lambda g, u: situ(g, u, c.get("activation_situ_beta", 4.0), c.get("activation_situ_linear_beta", 25.0))) if act == "situ" else (lambda g, u: torch.nn.functional.silu(g) * u)
        self.B = c.get("attn_res_block_size")
        self.w = lambda n: torch.from_numpy(ct.tensor(n).astype(np.float64))
        self.state = {}

    def kda(self, L, x):
        w, a = self.w, f"model.layers.{L}.self_attn."
        H, D, K = self.H, self.D, self.K
        C = H * D
        st = self.state.setdefault(L, {"hist": torch.zeros(K - 1, 3 * C), "S": torch.zeros(H, D, D)})
        qkv = torch.cat([w(a + "q_proj.weight") @ x, w(a + "k_proj.weight") @ x, w(a + "v_proj.weight") @ x])
        taps = torch.cat([w(a + f"{n}_conv1d.weight").reshape(C, K) for n in "qkv"])  # [3C, K], newest last
        seq = torch.cat([st["hist"], qkv[None]], 0)  # [K, 3C]
        conv = torch.nn.functional.silu((taps.T * seq).sum(0))
        st["hist"] = seq[1:]
        q, k, v = conv[:C].view(H, D), conv[C:2 * C].view(H, D), conv[2 * C:].view(H, D)
        z = (w(a + "f_b_proj.weight") @ (w(a + "f_a_proj.weight") @ x) + w(a + "dt_bias")).view(H, D)
        a_log = w(a + "A_log").reshape(-1)[:H][:, None]
        g = bounded_gate(z, a_log, self.lb) if self.lb is not None else softplus_gate(z, a_log)
        beta = torch.sigmoid(w(a + "b_proj.weight") @ x)
        o = torch.zeros(H, D)
        for hh in range(H):
            kh = k[hh] / torch.sqrt((k[hh] ** 2).sum() + 1e-6)
            qh = q[hh] / torch.sqrt((q[hh] ** 2).sum() + 1e-6) * D ** -0.5
            S = torch.exp(g[hh])[:, None] * st["S"][hh]
            uu = S.T @ kh
            d = beta[hh] * (v[hh] - uu)
            S = S + torch.outer(kh, d)
            st["S"][hh] = S
            o[hh] = S.T @ qh
        gate = (w(a + "g_proj.weight") @ x) if self.full_gate else (w(a + "g_b_proj.weight") @ (w(a + "g_a_proj.weight") @ x))
        o = rmsnorm(o, w(a + "o_norm.weight"), self.eps) * torch.sigmoid(gate.view(H, D))
        return w(a + "o_proj.weight") @ o.reshape(-1)

    def mla(self, L, x):
        c, w, a = self.c, self.w, f"model.layers.{L}.self_attn."
        nh, nope, rope, vd, kvl = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        if c.get("q_lora_rank"):
            q = w(a + "q_b_proj.weight") @ rmsnorm(w(a + "q_a_proj.weight") @ x, w(a + "q_a_layernorm.weight"), 1e-6)
        else:
            q = w(a + "q_proj.weight") @ x
        q = q.view(nh, nope + rope)
        ckv = w(a + "kv_a_proj_with_mqa.weight") @ x
        lat = rmsnorm(ckv[:kvl], w(a + "kv_a_layernorm.weight"), 1e-6)
        st = self.state.setdefault(L, {"lat": [], "rope": []})
        st["lat"].append(lat)
        st["rope"].append(ckv[kvl:])
        lat_all, rope_all = torch.stack(st["lat"]), torch.stack(st["rope"])  # [T, kvl], [T, rope]
        kv = (lat_all @ w(a + "kv_b_proj.weight").T).view(-1, nh, nope + vd)
        k = torch.cat([kv[..., :nope], rope_all[:, None, :].expand(-1, nh, -1)], -1)  # [T, nh, nope+rope]
        vals = kv[..., nope:]
        scores = torch.einsum("hd,thd->ht", q, k) * (nope + rope) ** -0.5
        att = torch.softmax(scores, -1)
        o = torch.einsum("ht,thd->hd", att, vals).reshape(-1)
        if c.get("mla_use_output_gate"):
            o = o * torch.sigmoid(w(a + "g_proj.weight") @ x)
        return w(a + "o_proj.weight") @ o

    def ffn(self, L, x):
        c, w = self.c, self.w
        if L < c.get("first_k_dense_replace", 0):
            m = f"model.layers.{L}.mlp."
            return w(m + "down_proj.weight") @ self.act(w(m + "gate_proj.weight") @ x, w(m + "up_proj.weight") @ x)
        m = f"model.layers.{L}.block_sparse_moe."
        s = torch.sigmoid(w(m + "gate.weight") @ x)
        choice = s + w(m + "gate.e_score_correction_bias")
        idx = torch.argsort(-choice, stable=True)[: c["num_experts_per_token"]]
        wts = s[idx]
        if c.get("moe_renormalize", True):
            wts = wts / (wts.sum() + 1e-20)
        wts = wts * c.get("routed_scaling_factor", 1.0)
        latent = c.get("routed_expert_hidden_size")
        hin = (w(m + "routed_expert_down_proj.weight") @ x) if latent else x
        y = torch.zeros_like(hin)
        for e, we in zip(idx.tolist(), wts):
            w1, w3, w2 = (torch.from_numpy(t.astype(np.float64)) for t in self.ct.expert(L, e))
            y = y + we * (w2 @ self.act(w1 @ hin, w3 @ hin))
        if latent:
            if c.get("latent_moe_use_norm"):
                y = rmsnorm(y, w(m + "routed_expert_norm.weight"), self.eps)
            y = w(m + "routed_expert_up_proj.weight") @ y
        if c.get("num_shared_experts", 0) > 0:
            sh = m + "shared_experts."
            y = y + w(sh + "down_proj.weight") @ self.act(w(sh + "gate_proj.weight") @ x, w(sh + "up_proj.weight") @ x)
        return y

    def step(self, tok, emb=None):
        w, eps = self.w, self.eps
        x = w("model.embed_tokens.weight")[tok] if emb is None else emb
        blocks = []
        for L in range(self.L):
            p = f"model.layers.{L}."
            attn = self.kda if self.kinds[L] == "kda" else self.mla
            if self.B:
                pp = x
                xin = attn_res(blocks, pp, w(p + "self_attention_res_norm.weight").reshape(-1), w(p + "self_attention_res_proj.weight").reshape(-1), eps) if blocks else pp
                restarted = L % self.B == 0
                if restarted:
                    blocks.append(pp)
                r = attn(L, rmsnorm(xin, w(p + "input_layernorm.weight"), eps))
                pp = r if restarted else pp + r
                xin = attn_res(blocks, pp, w(p + "mlp_res_norm.weight").reshape(-1), w(p + "mlp_res_proj.weight").reshape(-1), eps)
                r = self.ffn(L, rmsnorm(xin, w(p + "post_attention_layernorm.weight"), eps))
                x = pp + r
            else:
                x = x + attn(L, rmsnorm(x, w(p + "input_layernorm.weight"), eps))
                x = x + self.ffn(L, rmsnorm(x, w(p + "post_attention_layernorm.weight"), eps))
        if self.B:
            x = attn_res(blocks, x, w("model.output_attn_res_norm.weight").reshape(-1), w("model.output_attn_res_proj.weight").reshape(-1), eps)
        return w("lm_head.weight") @ rmsnorm(x, w("model.norm.weight"), eps)


def model(container, out, n):
    ct = Container(container)
    m = K3(ct)
    rng = np.random.default_rng(9)
    ids = [ct.config.get("bos_token_id", 0)] + rng.integers(0, 256, n - 1).tolist()
    with torch.no_grad():
        logits = [m.step(t).tolist() for t in ids]
        seq_next = int(np.argmax(logits[-1]))
        greedy = []
        for _ in range(6):
            greedy.append(seq_next)
            seq_next = int(torch.argmax(m.step(seq_next)))
    with open(out, "w") as f:
        json.dump({"_": "K3 reference logits (float64 PyTorch from MODEL.md) made by tools/oracle/k3_oracle.py", "ids": ids,
                   "logits": [[float(f"{v:.9g}") for v in row] for row in logits], "greedy": greedy}, f)


def write_png(path, a):
    """An 8-bit RGB or RGBA PNG (no PIL here): filter 0 per row, zlib."""
    import struct as st
    import zlib
    h, w, c = a.shape
    raw = b"".join(b"\x00" + a[y].tobytes() for y in range(h))

    def chunk(t, d):
        return st.pack(">I", len(d)) + t + d + st.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", st.pack(">IIBBBBB", w, h, 8, {3: 2, 4: 6}[c], 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


class Vision:
    """K3's vision tower and projector from MODEL.md, float64."""

    def __init__(self, ct):
        import os
        with open(os.path.join(ct.path, "vision.json")) as f:
            self.c = json.load(f)
        self.w = lambda n: torch.from_numpy(ct.tensor_full(n).astype(np.float64))
        self.eps = float(np.finfo(np.float32).eps)

    def grid(self, W, H):
        mp = self.c.get("max_patches", 1024)
        s = min(1.0, math.sqrt(mp / (W * H / 196)))
        gw = max(2, int(math.floor(W * s / 14 + 0.5))) & ~1
        gh = max(2, int(math.floor(H * s / 14 + 0.5))) & ~1
        while gw * gh > mp:
            if gw >= gh:
                gw -= 2
            else:
                gh -= 2
        return gw, gh

    def patches(self, img):
        H, W = img.shape[:2]
        gw, gh = self.grid(W, H)
        x = torch.tensor(img[..., :3].astype(np.float64)).permute(2, 0, 1)[None]  # alpha dropped
        if (W, H) != (14 * gw, 14 * gh):
            x = torch.nn.functional.interpolate(x, size=(14 * gh, 14 * gw), mode="bilinear", align_corners=False, antialias=False)
        mean = torch.tensor(self.c["image_mean"])[:, None, None]
        std = torch.tensor(self.c["image_std"])[:, None, None]
        x = (x[0] / 255.0 - mean) / std
        return x.reshape(3, gh, 14, gw, 14).permute(1, 3, 0, 2, 4).reshape(gh * gw, 588), gw, gh

    def embed(self, p, gw, gh):
        c, w = self.c, self.w
        D = c["vt_hidden_size"]
        x = p @ w("vision_tower.patch_embed.proj.weight").reshape(D, 588).T
        ph, pw = c["init_pos_emb_height"], c["init_pos_emb_width"]
        pos = w("vision_tower.patch_embed.pos_emb.weight").reshape(ph, pw, D).permute(2, 0, 1)[None]
        if (gh, gw) != (ph, pw):
            pos = torch.nn.functional.interpolate(pos, size=(gh, gw), mode="bilinear", align_corners=False, antialias=False)
        return x + pos[0].permute(1, 2, 0).reshape(gh * gw, D)

    def encode(self, p, gw, gh):
        c, w, eps = self.c, self.w, self.eps
        D, nh, Q = c["vt_hidden_size"], c["vt_num_attention_heads"], c["qkv_hidden_size"]
        hd = Q // nh
        N = gw * gh
        x = self.embed(p, gw, gh)
        idx = torch.arange(N)
        col, row = (idx % gw).double(), (idx // gw).double()
        j = torch.arange(hd // 2)
        freq = 10000.0 ** (-(4 * (j // 2)).double() / hd)
        ang = torch.where(j % 2 == 0, col[:, None], row[:, None]) * freq  # [N, hd/2]
        cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]

        def rope(t):  # [N, nh, hd], pairs (2j, 2j+1)
            a, b = t[..., 0::2], t[..., 1::2]
            return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(t.shape)
        for b in range(c["vt_num_hidden_layers"]):
            pre = f"vision_tower.encoder.blocks.{b}."
            h = rmsnorm(x, w(pre + "norm0.weight"), eps)
            qkv = h @ w(pre + "wqkv.weight").T
            q, k, v = (qkv[:, i * Q:(i + 1) * Q].reshape(N, nh, hd) for i in range(3))
            q, k = rope(q), rope(k)
            att = torch.softmax(torch.einsum("ihd,jhd->hij", q, k) * hd ** -0.5, -1)
            o = torch.einsum("hij,jhd->ihd", att, v).reshape(N, Q)
            x = x + o @ w(pre + "wo.weight").T
            h = rmsnorm(x, w(pre + "norm1.weight"), eps)
            h = torch.nn.functional.gelu(h @ w(pre + "mlp.fc0.weight").T, approximate="tanh")
            x = x + h @ w(pre + "mlp.fc1.weight").T
        y = rmsnorm(x, w("vision_tower.encoder.final_layernorm.weight"), eps)
        m = y.reshape(gh // 2, 2, gw // 2, 2, D).permute(0, 2, 1, 3, 4).reshape(-1, 4 * D)
        z = torch.nn.functional.gelu(m @ w("mm_projector.proj.0.weight").T)
        z = z @ w("mm_projector.proj.2.weight").T
        return rmsnorm(z, w("mm_projector.post_norm.weight"), 1e-5)


def vision(container, out_dir):
    import os
    ct = Container(container)
    vis = Vision(ct)
    m = K3(ct)
    pad = vis.c["media_placeholder_token_id"]
    with open(os.path.join(container, "specials.json")) as f:
        sp = {s["text"]: s["id"] for s in json.load(f)}
    rng = np.random.default_rng(31)
    # a: 84x56 RGB, whole patches (6x4, not resampled); b: 75x45 RGBA (resampled to 56x28)
    imgs = {"a.png": rng.integers(0, 256, (56, 84, 3), dtype=np.uint8),
            "b.png": rng.integers(0, 256, (45, 75, 4), dtype=np.uint8)}
    os.makedirs(out_dir, exist_ok=True)
    res = {"_": "K3 vision reference (float64 PyTorch from MODEL.md) made by tools/oracle/k3_oracle.py vision", "images": []}
    embs = []
    with torch.no_grad():
        for name, img in imgs.items():
            write_png(os.path.join(out_dir, name), img)
            p, gw, gh = vis.patches(img)
            e = vis.encode(p, gw, gh)
            embs.append(e)
            res["images"].append({"file": name, "width": img.shape[1], "height": img.shape[0], "grid": [gw, gh],
                                  "patch_embed": [[float(f"{v:.9g}") for v in r] for r in vis.embed(p, gw, gh).tolist()],
                                  "embedding": [[float(f"{v:.9g}") for v in r] for r in e.tolist()]})
        mb, mc, me = sp["<|media_begin|>"], sp["<|media_content|>"], sp["<|media_end|>"]
        ids = [ct.config.get("bos_token_id", 0), 17, 42, mb, 30, 31, mc, pad, me, 55, 60, 61, mb, 33, mc, pad, me, 70, 80, 90]
        logits, k = [], 0
        for t in ids:
            if t == pad:
                for r in embs[k]:
                    logits.append(m.step(None, r).tolist())
                k += 1
            else:
                logits.append(m.step(t).tolist())
        nxt = int(np.argmax(logits[-1]))
        greedy = []
        for _ in range(6):
            greedy.append(nxt)
            nxt = int(torch.argmax(m.step(nxt)))
    res.update({"ids": ids, "logits": [[float(f"{v:.9g}") for v in row] for row in logits], "greedy": greedy})
    with open(os.path.join(out_dir, "oracle.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["components", "model", "vision"])
    ap.add_argument("args", nargs="+")
    ap.add_argument("--len", type=int, default=36)
    a = ap.parse_args()
    if a.what == "components":
        components(a.args[0])
    elif a.what == "vision":
        vision(a.args[0], a.args[1])
    else:
        model(a.args[0], a.args[1], a.len)
