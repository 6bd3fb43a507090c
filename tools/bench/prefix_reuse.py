"""Prefix reuse in `waste serve`: a 3-turn conversation at temperature 0,
each turn timed against a server that reuses the previous turn's state and
against a fresh server (same answers expected).

    python tools/bench/prefix_reuse.py WASTE CONTAINER [--reps 2] [--ctx 1024] [--tokens 8]

Prints one line per turn and repetition: prompt tokens, tokens reused,
latency with reuse, latency fresh, same answer.
"""
import argparse
import json
import subprocess
import time
import urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("waste")
ap.add_argument("container")
ap.add_argument("--reps", type=int, default=2)
ap.add_argument("--ctx", type=int, default=1024)
ap.add_argument("--tokens", type=int, default=8)
a = ap.parse_args()


def start():
    p = subprocess.Popen([a.waste, "serve", a.container, "--port", "0", "--ctx", str(a.ctx)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return p, p.stdout.readline().strip().rsplit("http://", 1)[1]


def ask(addr, msgs):
    body = json.dumps({"messages": msgs, "max_tokens": a.tokens, "temperature": 0, "reasoning_effort": "none"}).encode()
    t = time.time()
    with urllib.request.urlopen(urllib.request.Request(f"http://{addr}/v1/chat/completions", body, {"Content-Type": "application/json"})) as r:
        v = json.load(r)
    return time.time() - t, v


questions = ["Tell me about the city of Paris and its history.", "What about its museums? Name a few and say why they matter.", "And the food: what should a visitor try first?"]
for rep in range(a.reps):
    srv, addr = start()
    msgs = []
    for i, q in enumerate(questions):
        msgs.append({"role": "user", "content": q})
        dt, v = ask(addr, msgs)
        fresh, faddr = start()
        fdt, fv = ask(faddr, msgs)
        fresh.kill()
        ans = v["choices"][0]["message"]["content"]
        print(f"rep {rep} turn {i + 1}: prompt {v['usage']['prompt_tokens']} reused {v['waste']['reused_prompt_tokens']} "
              f"with reuse {dt:.2f} s fresh {fdt:.2f} s same {ans == fv['choices'][0]['message']['content']}", flush=True)
        msgs.append({"role": "assistant", "content": ans})
    srv.kill()
