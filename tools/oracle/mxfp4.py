"""Independent MXFP4 decoder (numpy, from the OCP MX spec: E2M1 nibbles low
first, one E8M0 scale 2^(e-127) per 32 values) on random packed data.
Writes a fixture the Rust decoder must match bit for bit.

    python mxfp4.py OUT.json
"""
import json
import sys

import numpy as np

rng = np.random.default_rng(7)
rows, cols = 6, 96
packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
scales = rng.integers(100, 150, (rows, cols // 32), dtype=np.uint8)
lut = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
nib = np.empty((rows, cols), dtype=np.uint8)
nib[:, 0::2] = packed & 15
nib[:, 1::2] = packed >> 4
vals = lut[nib & 7] * np.where(nib & 8, -1.0, 1.0).astype(np.float32)
scale = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
out = (vals * np.repeat(scale, 32, axis=1)).astype(np.float32)
json.dump({"rows": rows, "cols": cols, "packed": packed.flatten().tolist(), "scales": scales.flatten().tolist(),
           "bits": out.view(np.uint32).flatten().tolist()}, open(sys.argv[1], "w"))
