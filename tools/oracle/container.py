"""Read a WASTE v0 container with numpy, independently of the Rust code.

Every tensor is dequantized with the rules of FORMAT.md (the spec), not by
calling the engine: F32, F16/BF16, Q8G, Q4G for the trunk; VQ3R / VQ2R / VQ4P
(blocked or row-major indices, per-row f16 scales), Q4G and F16/BF16 for experts.
"""
import json
import os
import struct

import numpy as np


def _f16(buf, off, n):
    return np.frombuffer(buf, dtype="<f2", count=n, offset=off).astype(np.float32)


def _grouped(buf, fmt, rows, cols, g, off, scale_off):
    """Q8G (fmt 2) or Q4G (fmt 3) rows: `q · scale` per group of `g` columns, rows padded to whole groups."""
    npad = -(-cols // g) * g
    if fmt == 2:
        q = np.frombuffer(buf, dtype=np.int8, count=rows * npad, offset=off).reshape(rows, npad).astype(np.float32)
    else:
        b = np.frombuffer(buf, dtype=np.uint8, count=rows * npad // 2, offset=off).reshape(rows, npad // 2)
        q = np.empty((rows, npad), dtype=np.float32)
        q[:, 0::2] = (b & 15).astype(np.float32) - 8.0  # low nibble first
        q[:, 1::2] = (b >> 4).astype(np.float32) - 8.0
    s = _f16(buf, scale_off, rows * (npad // g)).reshape(rows, npad // g)
    return (q * np.repeat(s, g, axis=1))[:, :cols]


def _bf16(buf, off, n):
    u = np.frombuffer(buf, dtype="<u2", count=n, offset=off).astype(np.uint32) << 16
    return u.view(np.float32)


class Container:
    def __init__(self, path):
        self.path = path
        with open(os.path.join(path, "manifest.json")) as f:
            self.manifest = json.load(f)
        assert self.manifest["format_version"] == 0
        self.config = self.manifest["config"]
        if "text_config" in self.config:
            outer = dict(self.config)
            self.config = dict(outer.pop("text_config"))
            self.config["_outer"] = outer
        self.prefix = self.manifest.get("tensor_prefix", "")
        with open(os.path.join(path, "trunk.bin"), "rb") as f:
            self.trunk = f.read()
        self.index = {t["name"]: t for t in self.manifest["trunk"]}
        self.quant = self.manifest.get("expert_quant")
        self.books = None
        if self.quant and self.quant["fmt"] in ("VQ3R", "VQ2R", "VQ4P"):
            with open(os.path.join(path, "codebooks.bin"), "rb") as f:
                cb = f.read()
            e, d = self.quant["entries"], self.quant["vec_dim"]
            rl = 16 + e * d * 2
            self.books = []
            for i in range(len(cb) // rl):
                magic, cid, fmt, vd, ne, _ = struct.unpack_from("<IHBBII", cb, i * rl)
                assert magic == 0x4B424357 and cid == i and vd == d and ne == e
                self.books.append(_f16(cb, i * rl + 16, e * d).reshape(e, d))

    def tensor(self, name):
        return self.tensor_full(self.prefix + name)

    def tensor_full(self, name):
        """A trunk tensor by its full name (the vision tower's live outside the text prefix)."""
        t = self.index[name]
        shape = t["shape"]
        cols = shape[-1]
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        fmt, off = t["fmt"], t["off"]
        if fmt == 0:
            a = np.frombuffer(self.trunk, dtype="<f4", count=rows * cols, offset=off).copy()
        elif fmt == 1:
            a = (_bf16 if t.get("dtype") == "bf16" else _f16)(self.trunk, off, rows * cols)
        elif fmt in (2, 3):
            a = _grouped(self.trunk, fmt, rows, cols, t["group"], off, t["scale_off"])
        else:
            raise ValueError(f"fmt {fmt}")
        return np.ascontiguousarray(a.reshape(shape), dtype=np.float32)

    def expert(self, layer, e):
        """(w1 gate [M, lat], w3 up [M, lat], w2 down [lat, M]) of one expert, dequantized."""
        c = self.config
        m = c["moe_intermediate_size"]
        lat = c.get("routed_expert_hidden_size") or c["hidden_size"]
        bank = self.manifest["layers"][str(layer)]
        rec_bytes = bank["bytes"] // bank["experts"]
        with open(os.path.join(self.path, bank["file"]), "rb") as f:
            f.seek(e * rec_bytes)
            rec = f.read(rec_bytes)
        h = struct.unpack_from("<IHHBBHHHIIIIII2I", rec, 0)
        assert h[0] == 0x50584557 and h[1] == layer and h[2] == e
        offs = h[9:13]
        fmt = self.quant["fmt"]
        shapes = [(m, lat), (m, lat), (lat, m)]
        if fmt in ("F16", "BF16"):
            dec = _f16 if fmt == "F16" else _bf16
            return [dec(rec, offs[k], r * cc).reshape(r, cc) for k, (r, cc) in enumerate(shapes)]
        if fmt == "Q4G":
            # scales after the matrices: gate, up, down, one per group of a row
            g = self.quant["group"]
            so, out = offs[3], []
            for k, (r, cc) in enumerate(shapes):
                out.append(_grouped(rec, 3, r, cc, g, offs[k], so))
                so += 2 * r * (-(-cc // g))
            return out
        q = self.quant
        stages, d, ib = q["stages"], q["vec_dim"], q["index_block"]
        sc = _f16(rec, offs[3], 2 * m + lat)
        scales = [sc[:m], sc[m:2 * m], sc[2 * m:]]
        out = []
        for k, (rows, cols) in enumerate(shapes):
            nvec = cols // d
            rows_p = -(-rows // ib) * ib if ib else rows
            bpv = 3 if fmt == "VQ4P" else stages
            raw = np.frombuffer(rec, dtype=np.uint8, count=rows_p * nvec * bpv, offset=offs[k])
            if ib:
                raw = raw.reshape(rows_p // ib, nvec, ib, bpv).transpose(0, 2, 1, 3).reshape(rows_p, nvec, bpv)
            else:
                raw = raw.reshape(rows_p, nvec, bpv)
            if fmt == "VQ4P":
                b0, b1, b2 = (raw[..., i].astype(np.int64) for i in range(3))
                idx = np.stack([b0 & 63, (b0 >> 6) | ((b1 & 15) << 2), (b1 >> 4) | ((b2 & 3) << 4), b2 >> 2], axis=-1)
            else:
                idx = raw.astype(np.int64)
            base = bank["codebook_base"] + k * stages
            w = np.zeros((rows_p, nvec, d), dtype=np.float32)
            for s in range(stages):
                w += self.books[base + s][idx[..., s]]
            w = w[:rows].reshape(rows, cols) * scales[k][:, None]
            out.append(w)
        return out
