#!/usr/bin/env python3
"""Streaming benchmark: `waste bench` over budgets and on/off switches,
alternating runs, medians and ranges. Usage:

    python3 tools/bench/streaming.py CONTAINER [--runs 3] [--n 12]

Prints a Markdown table (for docs/lab/)."""
import argparse
import json
import statistics
import subprocess
import sys

ap = argparse.ArgumentParser()
ap.add_argument("container")
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--n", type=int, default=12)
ap.add_argument("--waste", default="target/release/waste")
ap.add_argument("--configs", default="budgets,readahead,lookahead")
args = ap.parse_args()

configs = []
if "budgets" in args.configs:
    for b in ["1.5G", "3G", "6G", "12G"]:
        configs.append((f"budget {b}", ["--budget", b, "--lookahead", "0"]))
if "readahead" in args.configs:
    configs.append(("1.5G read-ahead off", ["--budget", "1.5G", "--no-readahead"]))
    configs.append(("1.5G read-ahead on", ["--budget", "1.5G"]))
if "lookahead" in args.configs:
    for la in [0, 2, 4, 8]:
        configs.append((f"3G lookahead {la}", ["--budget", "3G", "--lookahead", str(la)]))

results = {name: [] for name, _ in configs}
for r in range(args.runs):  # alternate configurations run by run
    for name, extra in configs:
        out = subprocess.run([args.waste, "bench", args.container, "-n", str(args.n), "--json", "--ctx", "512"] + extra,
                             capture_output=True, text=True, check=True).stdout
        results[name].append(json.loads(out))
        print(f"run {r} {name}: {results[name][-1]['tok_per_s']:.3f} tok/s", file=sys.stderr)

def med(xs):
    return statistics.median(xs), min(xs), max(xs)

print("| config | tok/s median (range) | ms/token | hit rate | GB read/token | io wait ms/token | prefetch used/issued | direct I/O | huge pages |")
print("|---|---|---|---|---|---|---|---|---|")
for name, _ in configs:
    rs = results[name]
    t = med([x["tok_per_s"] for x in rs])
    print(f"| {name} | {t[0]:.3f} ({t[1]:.3f}–{t[2]:.3f}) | {statistics.median(x['ms_per_token'] for x in rs):.0f} | "
          f"{statistics.median(x['hit_rate'] for x in rs):.3f} | {statistics.median(x['bytes_per_token'] for x in rs) / 1e9:.3f} | "
          f"{statistics.median(x['io_wait_ms_per_token'] for x in rs):.1f} | "
          f"{sum(x['prefetch_used'] for x in rs)}/{sum(x['prefetch_issued'] for x in rs)} | {rs[0]['direct_io']} | {rs[0]['huge_pages']} |")
