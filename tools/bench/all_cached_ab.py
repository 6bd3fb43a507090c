#!/usr/bin/env python3
"""Decode with every expert cached, two binaries alternated: issue 50's line
"with every expert cached on the 48B shape, decode at WASTE_SIMD=avx2 is
>= 2x this issue's starting commit at the same level", as the labs measure
it (docs/lab entries 81-83).

    python3 tools/bench/all_cached_ab.py OLD_BIN NEW_BIN MODEL [--level avx2]
            [--rounds 5] [-n 32] [--budget 20G]

MODEL: e.g. `cargo xtask synth --shape kimi-linear-48b --out /tmp/k48.waste`
(18.4 GB; the budget must hold every expert). Writes a usage hotlist naming
every expert (FORMAT.md "usage.waste"; a temporary file, removed at the
end) so each run opens with all of them resident, runs NEW once as a
warm-up (the first run after a larger footprint is slow on these VMs; not
counted), then ROUNDS rounds of OLD then NEW, each `waste bench MODEL
--budget B --usage HOTLIST -n N --prompt-len 8 --prefill-repeats 0 --json`
at `WASTE_SIMD=LEVEL`. Prints each run, then the medians and ranges and the
speed-up OLD/NEW by medians and per round. Nothing else may run meanwhile.
Only the standard library.
"""
import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile

ap = argparse.ArgumentParser()
ap.add_argument("old")
ap.add_argument("new")
ap.add_argument("model")
ap.add_argument("--level", default="avx2", help="WASTE_SIMD for every run ('' = the machine's best)")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("-n", type=int, default=32, help="decode steps a run")
ap.add_argument("--budget", default="20G")
a = ap.parse_args()
if a.rounds < 1 or a.n < 1:
    ap.error("--rounds and -n: at least 1")


def info(binary):
    out = subprocess.run([binary, "info", a.model, "--json"], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def hotlist(layers, experts):
    """Every (layer, expert): the reader skips layers without experts."""
    fd, path = tempfile.mkstemp(suffix=".usage")
    with os.fdopen(fd, "wb") as fh:
        fh.write(struct.pack("<IIQ", 0x47535557, 1, 1))
        for layer in range(layers):
            for e in range(experts):
                fh.write(struct.pack("<HHIII", layer, e, 1, 0, 0))
    return path


def bench(binary, usage):
    env = dict(os.environ)
    if a.level:
        env["WASTE_SIMD"] = a.level
    cmd = [binary, "bench", a.model, "--budget", a.budget, "--usage", usage, "-n", str(a.n), "--prompt-len", "8",
           "--prefill-repeats", "0", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{binary} bench failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout)


def line(tag, d):
    parts = [f"{d['ms_per_token']:.1f} ms/token"]
    for k, name in (("expert_ms_per_token", "experts"), ("attention_ms_per_token", "attention"),
                    ("trunk_ms_per_token", "trunk")):
        if k in d:
            parts.append(f"{name} {d[k]:.1f}")
    if d.get("roofline_share") is not None:
        parts.append(f"share {d['roofline_share']:.2f}")
    if d.get("expert_kernel"):
        parts.append(str(d["expert_kernel"]))
    print(f"{tag}: " + ", ".join(parts), flush=True)


def main():
    i = info(a.new)
    usage = hotlist(i["layers"], i["experts"])
    try:
        line("warm-up (new, not counted)", bench(a.new, usage))
        old, new = [], []
        for r in range(1, a.rounds + 1):
            d = bench(a.old, usage)
            line(f"round {r} old", d)
            old.append(d["ms_per_token"])
            d = bench(a.new, usage)
            line(f"round {r} new", d)
            new.append(d["ms_per_token"])
    finally:
        os.unlink(usage)
    mo, mn = statistics.median(old), statistics.median(new)
    print(f"old {mo:.1f} ms/token ({min(old):.1f}-{max(old):.1f}), new {mn:.1f} ({min(new):.1f}-{max(new):.1f}); "
          f"level {a.level or 'best'}")
    print(f"speed-up by medians {mo / mn:.2f}x; per round " + ", ".join(f"{o / n:.2f}" for o, n in zip(old, new)))


main()
