"""WASTE-rs against llama.cpp on a model that fits in RAM (issue 12's parity check).

    python tools/bench/llama_parity.py --llama-src DIR --waste target/release/waste --work /tmp/parity
           [--layers 3] [--tokens 16] [--runs 3] [--threads 2] [--experts vq3r,q4g]
           [--heads q8,q4] [--llama-heads q6_k,q8_0,q4_k] [--levels avx512,avx2] [--modes exact,fast]

Builds, once, in WORK (about 30 GB at the peak; the intermediate files are
deleted as soon as they are used):
  hf/                 a slice of the Kimi-Linear-48B shape (the first LAYERS
                      layers: hidden 2304, 256 experts top-8, KDA 32x128,
                      MLA 32 heads, vocab 163840; the last layer is MLA when
                      the slice is too short to reach the 4th) with random
                      bf16 weights from transformers' own initialisation,
                      saved by save_pretrained; the
                      layer-0 dense FFN renamed to the release's `mlp.*` names
                      (transformers saves it under `block_sparse_moe.*`)
  slice-q4km.gguf     llama.cpp's convert_hf_to_gguf.py (bf16), then
                      llama_model_quantize to Q4_K_M
  slice.waste         `waste convert --experts vq3r --trunk q4`
  slice-q4g.waste     `waste convert --experts q4g --trunk q4` (4-bit groups:
                      the expert format for models that fit in RAM)
  ...-head-q4.waste   the same with `--head q4` for each HEADS entry q4
  slice-q4km-head-T.gguf  Q4_K_M with the output tensor at T (llama-quantize's
                      --output-tensor-type) for each LLAMA_HEADS entry besides
                      q6_k, Q4_K_M's own: the head is most of a token's bytes
                      on this slice, so these compare the engines at equal
                      head precision
Then (RUNS 0: stop here) alternates RUNS runs of each engine, everything resident (llama.cpp
loads the whole file; WASTE-rs preloads every expert from a usage hotlist
naming them all), THREADS
threads, prompt ids 1..8, greedy: llama.cpp through llama-cpp-python
(`Llama.eval`, timing the 8-token prefill and each decode step, then the
same prefill 3 more times on a reset context) and
`waste bench --budget 20G --json` (the same ids and loop, and its
`prefill_warm_ms_per_token`: the prompt 3 more times on a reset session) on
each container EXPERTS names, at each WASTE_SIMD level LEVELS names (the
best the CPU has when empty) and in each numeric mode MODES names. Prints a markdown table of medians and
ranges (ms per token). The first prefill after a load and the repeated one
differ on a VM whose cores were idle through an I/O-bound load
(docs/lab/2026-12-03-43-a-first-prefill-after-an-i-o-bound-open.md, nineteenth session); both are shown.

Needs the oracle venv (torch, transformers, numpy) with llama-cpp-python
installed from the same sdist as DIR (CMAKE_ARGS="-DGGML_NATIVE=ON").
The slice's vocabulary is not a tokenizer: the GGUF gets tokenizer model
"none" (ids are fed directly), as in tools/oracle/llama_k3.py.
"""
import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "oracle"))
from kimi_linear_slice import rename_dense, slice_48b_config  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--llama-src", required=True)
ap.add_argument("--waste", required=True)
ap.add_argument("--work", required=True)
ap.add_argument("--layers", type=int, default=3)
ap.add_argument("--tokens", type=int, default=16)
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--experts", default="vq3r,q4g", help="WASTE-rs expert formats to convert and run (comma-separated)")
ap.add_argument("--heads", default="q8", help="WASTE-rs head formats (`waste convert --head`): q8 (the default), q4; comma-separated")
ap.add_argument("--llama-heads", default="q6_k",
                help="llama.cpp output-tensor types beside Q4_K_M's own q6_k: q8_0, q4_k (llama-quantize's "
                     "--output-tensor-type); comma-separated")
ap.add_argument("--levels", default="",
                help="WASTE_SIMD levels to run WASTE-rs at (comma-separated, e.g. avx512,avx2); empty: the best the CPU has")
ap.add_argument("--modes", default="exact", help="WASTE-rs numeric modes to run: exact, fast (comma-separated)")
ap.add_argument("--only-slice", action="store_true", help="build the HF slice and the WASTE containers, then stop")
a = ap.parse_args()
os.makedirs(a.work, exist_ok=True)
hf = os.path.join(a.work, "hf")


def names(s):
    return [f.strip().lower() for f in s.split(",") if f.strip()]


FORMATS = names(a.experts)
HEADS = names(a.heads)
LEVELS = names(a.levels) or [""]
MODES = names(a.modes)
LLAMA_HEADS = {"q6_k": 14, "q8_0": 8, "q4_k": 12}
for h in names(a.llama_heads):
    if h not in LLAMA_HEADS:
        sys.exit(f"--llama-heads {h}: expected one of {', '.join(LLAMA_HEADS)}")
# Q4_K_M's own head (q6_k) keeps the name earlier runs of this script gave it
ggufs = {h: os.path.join(a.work, "slice-q4km.gguf" if h == "q6_k" else f"slice-q4km-head-{h}.gguf")
         for h in names(a.llama_heads)}
# vq3r with the default head keeps the name earlier runs of this script gave it
containers = {(f, h): os.path.join(a.work, ("slice" if f == "vq3r" else f"slice-{f}") + ("" if h == "q8" else f"-head-{h}")
                                   + ".waste") for f in FORMATS for h in HEADS}
PROMPT = list(range(1, 9))


def log(*x):
    print(*x, file=sys.stderr, flush=True)


def make_slice():
    sys.modules["fla"] = None
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = slice_48b_config(KimiLinearConfig, a.layers)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # the init itself in bf16: the f32 model would not fit beside its copy
    model = KimiLinearForCausalLM(cfg).eval()
    log("slice initialised; saving")
    model.save_pretrained(hf, max_shard_size="2GB")
    del model
    rename_dense(hf)


def release_config():
    """Add the release's config keys llama.cpp's converter reads (transformers
    writes its own: layer_types, linear_head_dim, ...); idempotent."""
    path = os.path.join(hf, "config.json")
    with open(path) as fh:
        c = json.load(fh)
    if "moe_router_activation_func" in c:
        return
    types = c["layer_types"]
    c["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "kda_layers": [i + 1 for i, t in enumerate(types) if t != "full_attention"],
        "head_dim": c["linear_head_dim"], "num_heads": c["linear_num_heads"],
        "short_conv_kernel_size": c.get("linear_conv_kernel_dim", 4)}
    c["first_k_dense_replace"] = c["mlp_layer_types"].index("sparse")
    c["moe_router_activation_func"] = "sigmoid"  # the release's router (transformers' own code hard-wires it)
    with open(path, "w") as fh:
        json.dump(c, fh, indent=1)


def make_gguf():
    sys.path.insert(0, a.llama_src)
    sys.path.insert(0, os.path.join(a.llama_src, "gguf-py"))
    import convert_hf_to_gguf
    from conversion.kimi_linear import KimiLinearModel

    KimiLinearModel.set_vocab = lambda self: self.gguf_writer.add_tokenizer_model("none")
    bf16 = os.path.join(a.work, "slice-bf16.gguf")
    sys.argv = ["convert_hf_to_gguf.py", hf, "--outtype", "bf16", "--outfile", bf16]
    convert_hf_to_gguf.main()
    import llama_cpp

    for h, path in ggufs.items():
        if os.path.exists(path):
            continue
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        p.nthread = a.threads
        if h != "q6_k":
            p.output_tensor_type = LLAMA_HEADS[h]
        rc = llama_cpp.llama_model_quantize(bf16.encode(), path.encode(), p)
        if rc != 0:
            sys.exit(f"llama_model_quantize failed: {rc}")
    os.remove(bf16)


def run_llama(gguf):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=64, n_batch=64, n_threads=a.threads, n_threads_batch=a.threads,
                          verbose=False, use_mmap=False)
    import numpy as np

    t = time.perf_counter()
    llm.eval(PROMPT)
    prefill = (time.perf_counter() - t) / len(PROMPT)
    steps = []
    seq = list(PROMPT)
    for _ in range(a.tokens):
        nxt = int(np.argmax(llm.scores[len(seq) - 1]))
        seq.append(nxt)
        t = time.perf_counter()
        llm.eval([nxt])
        steps.append(time.perf_counter() - t)
    # the same prompt again on a reset context, as `bench` repeats it
    # (--prefill-repeats 3): a later prompt in a running process
    warm = []
    for _ in range(3):
        llm.reset()
        t = time.perf_counter()
        llm.eval(PROMPT)
        warm.append((time.perf_counter() - t) / len(PROMPT))
    del llm
    return 1e3 * prefill, 1e3 * statistics.median(steps), 1e3 * statistics.median(warm)


def all_experts_usage():
    """A usage hotlist naming every expert (FORMAT.md "usage.waste"), so the
    bench opens with all of them resident, as llama.cpp loads its whole file."""
    path = os.path.join(a.work, "all-experts.usage")
    entries = [(l, e) for l in range(1, a.layers) for e in range(256)]
    with open(path, "wb") as fh:
        fh.write(struct.pack("<IIQ", 0x47535557, 1, 1))
        for l, e in entries:
            fh.write(struct.pack("<HHIII", l, e, 1, 0, 0))
    return path


def run_waste(container, level, mode):
    env = dict(os.environ)
    if level:
        env["WASTE_SIMD"] = level
    o = subprocess.run([a.waste, "bench", container, "--budget", "20G", "--threads", str(a.threads), "-n", str(a.tokens),
                        "--prompt-len", str(len(PROMPT)), "--usage", all_experts_usage(), "--json", f"--{mode}"],
                       capture_output=True, text=True, check=True, env=env)
    v = json.loads(o.stdout)
    return v["prefill_ms_per_token"], v["ms_per_token"], v["prefill_warm_ms_per_token"], v


def converted(c):
    return os.path.exists(os.path.join(c, "manifest.json"))


have_all = all(converted(c) for c in containers.values()) and all(os.path.exists(g) for g in ggufs.values())
if not os.path.exists(os.path.join(hf, "config.json")) and not have_all:
    # the HF slice is only an intermediate: the converted files suffice
    make_slice()
for (f, h), c in containers.items():
    if not converted(c):
        subprocess.run([a.waste, "convert", "--src", hf, "--out", c, "--experts", f, "--trunk", "q4", "--head", h, "-q"],
                       check=True)
if a.only_slice:
    sys.exit(0)
if not all(os.path.exists(g) for g in ggufs.values()):
    release_config()
    make_gguf()
if a.runs == 0:
    sys.exit(0)  # everything built; nothing timed


def llama_name(h):
    return "llama.cpp Q4_K_M" + ("" if h == "q6_k" else f", {h.upper()} head")


def waste_name(f, h, lv="", md="exact"):
    return (f"WASTE-rs {f.upper()} experts + Q4G trunk" + ("" if h == "q8" else f", {h.upper()}G head")
            + (f", {lv}" if lv else "") + (f", {md}" if md != "exact" else ""))


variants = [(f, h, lv, md) for (f, h) in containers for lv in LEVELS for md in MODES]
res = {llama_name(h): ([], [], []) for h in ggufs}
res.update({waste_name(*v): ([], [], []) for v in variants})
last = {}
for r in range(a.runs):
    line = f"run {r + 1}:"
    for h, g in ggufs.items():
        p, d, w = run_llama(g)
        for xs, x in zip(res[llama_name(h)], (p, d, w)):
            xs.append(x)
        line += f" llama.cpp {h} head {d:.1f} / {p:.1f} / {w:.1f},"
    for v in variants:
        p, d, w, last[v] = run_waste(containers[v[:2]], v[2], v[3])
        for xs, x in zip(res[waste_name(*v)], (p, d, w)):
            xs.append(x)
        line += f" {waste_name(*v)[9:]} {d:.1f} / {p:.1f} / {w:.1f},"
    log(line.rstrip(",") + " ms per token (decode / first prefill / prefill again)")


def fmt(xs):
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}–{max(xs):.1f})"


print(f"| engine ({a.layers}-layer 48B slice, {a.threads} threads, {a.runs} alternated runs) | decode ms/token "
      "| prefill ms/token (8 ids, first after the load) | the same prefill again (median of 3 in the process) |")
print("|---|---|---|---|")
for k, (p, d, w) in res.items():
    print(f"| {k} | {fmt(d)} | {fmt(p)} | {fmt(w)} |")
for k, v in last.items():
    print(f"\n{waste_name(*k)} (last run): roofline share {v['roofline_share']:.2f}, simd {v['simd']}, hit rate {v['hit_rate']:.3f}, "
          f"split ms/token: experts {v['expert_ms_per_token']:.1f}, attention {v['attention_ms_per_token']:.1f}, "
          f"trunk {v['trunk_ms_per_token']:.1f}, I/O wait {v['io_wait_ms_per_token']:.1f}; "
          f"prefill split ms/token: experts {v.get('prefill_expert_ms_per_token', float('nan')):.1f}, "
          f"attention {v.get('prefill_attention_ms_per_token', float('nan')):.1f}, "
          f"trunk {v.get('prefill_trunk_ms_per_token', float('nan')):.1f}, "
          f"I/O wait {v.get('prefill_io_wait_ms_per_token', float('nan')):.1f}, "
          f"prefill roofline share {v.get('prefill_roofline_share', float('nan')):.2f}; "
          f"cores' bound ms/token: decode {v.get('roofline_compute_ms_per_token', float('nan')):.1f} "
          f"(attainable share {v.get('attainable_share', float('nan')):.2f}), "
          f"prefill {v.get('prefill_roofline_compute_ms_per_token', float('nan')):.1f} "
          f"(attainable share {v.get('prefill_attainable_share', float('nan')):.2f})")
for h, g in ggufs.items():
    print(f"\nGGUF {llama_name(h)}: {os.path.getsize(g) / 1e9:.2f} GB")
