#!/usr/bin/env python3
"""The Markdown table of a `tools/bench/ab.sh` run: per budget and binary,
medians (ranges) over its runs of open + one token, decode and its split,
the hit rate, the first prefill, `open_seconds`, the roofline and its
share, the bound `bench` names and the share of the cores' bound.

    python3 tools/bench/ab_table.py AB_OUTPUT

AB_OUTPUT: what ab.sh printed (one record per run; the bench JSON inside
spans several lines). Keys a binary does not report (an older `bench`)
print as –.
"""
import json
import statistics
import sys


def records(text):
    dec = json.JSONDecoder()
    i = 0
    while (j := text.find('{"bin"', i)) >= 0:
        rec, i = dec.raw_decode(text, j)
        yield rec


def med(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    if not xs:
        return "–"
    f = lambda v: f"{v:.3g}"
    return f"{f(statistics.median(xs))} ({f(min(xs))}–{f(max(xs))})"


def prefill(b):
    if b.get("prefill_ms_per_token") is not None:
        return b["prefill_ms_per_token"]
    return 1e3 * b["prefill_seconds"] / b["prefill_tokens"] if b.get("prefill_tokens") else None


def main():
    recs = list(records(open(sys.argv[1]).read()))
    cols = ["open+1 s", "decode ms/tok", "hit", "experts", "attn", "trunk", "io wait", "prefill ms/tok", "open s",
            "roofline ms", "share", "bound", "attainable share"]
    print("| budget | bin | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    budgets = list(dict.fromkeys(r["budget"] for r in recs))
    for budget in budgets:
        for side in "AB":
            rs = [r for r in recs if r["budget"] == budget and r["bin"] == side]
            if not rs:
                continue
            g = lambda k: med([r["bench"].get(k) for r in rs])
            bounds = "/".join(sorted({str(r["bench"].get("roofline_bound", "–")) for r in rs}))
            row = [med([r["open_plus_one_s"] for r in rs]), g("ms_per_token"), g("hit_rate"), g("expert_ms_per_token"),
                   g("attention_ms_per_token"), g("trunk_ms_per_token"), g("io_wait_ms_per_token"),
                   med([prefill(r["bench"]) for r in rs]), g("open_seconds"), g("roofline_ms_per_token"),
                   g("roofline_share"), bounds, g("attainable_share")]
            print(f"| {budget} | {side} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
