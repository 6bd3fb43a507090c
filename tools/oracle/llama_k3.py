"""llama.cpp's `kimi-k3` model as an oracle for a HF-form tiny K3.

    python llama_k3.py LLAMA_CPP_SRC HF_DIR OUT.json [--len 32] [--greedy 8]

LLAMA_CPP_SRC is llama.cpp's source tree (vendor/llama.cpp of the
llama-cpp-python sdist, whose library must be installed in this Python:
`pip install llama-cpp-python==0.3.36`). Converts HF_DIR with llama.cpp's own
`convert_hf_to_gguf.py` (K3 converter, --outtype f32), then evaluates a
prompt with llama.cpp (f32 KV cache, one sequence) and writes the logits at
every position plus the greedy continuation.

Three things are changed around the converter, none in the model math:
- the vocabulary: the tiny model has no Kimi tiktoken files, so the GGUF gets
  tokenizer model "none" with the config's vocab_size (ids are fed directly);
- the MXFP4 experts are decoded to f32 with llama.cpp's own repack
  (`repack_mxfp4_blocks`) and gguf-py's MXFP4 dequantizer, instead of being
  stored as ggml MXFP4: on the CPU llama.cpp multiplies MXFP4 weights with
  activations quantized to Q8_0, an error of ~1e-3 that would hide
  everything else;
- nothing else: norms, gates, routing, attention residuals are llama.cpp's.
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("llama_src")
ap.add_argument("hf_dir")
ap.add_argument("out")
ap.add_argument("--len", type=int, default=32)
ap.add_argument("--greedy", type=int, default=8)
ap.add_argument("--seed", type=int, default=4)
args = ap.parse_args()

sys.path.insert(0, args.llama_src)
sys.path.insert(0, os.path.join(args.llama_src, "gguf-py"))
import torch  # noqa: E402
import gguf  # noqa: E402
from gguf.quants import dequantize  # noqa: E402
import convert_hf_to_gguf  # noqa: E402
from conversion.base import ModelBase  # noqa: E402
from conversion.kimi_k3 import KimiK3Model  # noqa: E402


def set_vocab(self):
    self.gguf_writer.add_tokenizer_model("none")


def dequant_model(self):
    for name in list(self.model_tensors):
        m = KimiK3Model._MXFP4_EXPERT_RE.match(name)
        if not m:
            continue
        base = name.removesuffix("_packed")
        packed, scale = self.model_tensors.pop(name), self.model_tensors.pop(base + "_scale")

        def load(packed=packed, scale=scale):
            raw = ModelBase.repack_mxfp4_blocks(packed(), scale())
            return torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType.MXFP4).astype(np.float32))

        self.model_tensors[base] = load


KimiK3Model.set_vocab = set_vocab
KimiK3Model._is_mxfp4_packed = lambda self: False
KimiK3Model.dequant_model = dequant_model

tmp = tempfile.mkdtemp(prefix="waste-llama-k3-")
gguf_path = os.path.join(tmp, "k3-tiny-f32.gguf")
sys.argv = ["convert_hf_to_gguf.py", args.hf_dir, "--outtype", "f32", "--outfile", gguf_path]
convert_hf_to_gguf.main()

import llama_cpp  # noqa: E402

with open(os.path.join(args.hf_dir, "config.json")) as f:
    tc = json.load(f)["text_config"]
rng = np.random.default_rng(args.seed)
ids = [tc["bos_token_id"]] + rng.integers(0, 256, args.len - 1).tolist()

llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=256, n_batch=256, n_ubatch=256, logits_all=True, verbose=False,
                      type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, n_threads=1, flash_attn=False)
llm.eval(ids)
logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
seq, greedy = list(ids), []
for _ in range(args.greedy):
    nxt = int(np.argmax(llm.scores[len(seq) - 1]))
    greedy.append(nxt)
    seq.append(nxt)
    llm.eval([nxt])
with open(args.out, "w") as f:
    json.dump({"_": "llama.cpp kimi-k3 (llama-cpp-python " + llama_cpp.__version__ + ") logits for the HF-form tiny K3 in this directory; made by tools/oracle/llama_k3.py",
               "ids": ids, "logits": [[float(f"{v:.8g}") for v in r] for r in logits], "greedy": greedy}, f)
print("ok", args.out, logits.shape)
