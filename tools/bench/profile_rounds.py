"""Split a CPU profile by prefill round: what the process's first prefill
spends beyond a later one, symbol by symbol.

    perf record -F 20000 -k realtime -o P.data \\
        target/release/examples/prefill_loop MODEL USAGE 8 9 > ROUNDS.txt
    perf script -i P.data > P.txt
    python3 tools/bench/profile_rounds.py ROUNDS.txt P.txt [TOP]

`prefill_loop` (waste-model/examples) prints a `round R START END` line per
prefill (wall-clock seconds, CLOCK_REALTIME, which `perf record -k realtime`
stamps its samples with). Each sample of `perf script`'s default output
falls into the round whose window holds it; the table lists, per symbol,
the first round's samples, the later rounds' median and the difference,
largest first (samples of every thread, the pool's included). Standard
library only.
"""
import collections
import re
import statistics
import sys

rounds = []
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) >= 4 and p[0] == "round" and p[1].isdigit():
        rounds.append((float(p[2]), float(p[3])))
if len(rounds) < 2:
    sys.exit("need at least two `round R START END` lines (prefill_loop with ROUNDS >= 2)")
top = int(sys.argv[3]) if len(sys.argv) > 3 else 25
# "comm tid time: period event: ip symbol+off (dso)"
SAMPLE = re.compile(r"\s*.+?\s+\d+\s+([\d.]+):\s+\d+\s+\S+:\s+[0-9a-f]+\s+(.*)$")
counts = [collections.Counter() for _ in rounds]
for line in open(sys.argv[2]):
    m = SAMPLE.match(line)
    if not m:
        continue
    t = float(m.group(1))
    sym = re.sub(r"\s*\(.*\)$", "", m.group(2).strip())
    sym = re.sub(r"\+0x[0-9a-f]+$", "", sym)
    for i, (a, b) in enumerate(rounds):
        if a <= t <= b:
            counts[i][sym] += 1
            break
print("samples per round:", [sum(c.values()) for c in counts])
later = counts[1:]
rows = []
for s in set().union(*counts):
    med = statistics.median(c[s] for c in later)
    rows.append((counts[0][s] - med, counts[0][s], med, s))
rows.sort(reverse=True)
print(f"{'first - later':>13} {'first':>7} {'later':>7}  symbol")
for d, f, med, s in rows[:top]:
    print(f"{d:13.1f} {f:7d} {med:7.1f}  {s[:100]}")
