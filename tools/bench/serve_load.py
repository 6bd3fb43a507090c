"""N concurrent streaming clients against `waste serve --parallel P` (issue 47).

    python tools/bench/serve_load.py --waste target/release/waste --model M.waste
           [--parallel 8] [--clients 8] [--max-tokens 32] [--budget 20G] [--ctx 1024]
           [--rounds 2] [--json OUT]

Starts the server on loopback (a free port), then:

1. each client's request alone, one after another (the reference: a
   request alone is a batch of one), streamed;
2. ROUNDS times, all CLIENTS requests at once, streamed, while a poller asks
   `GET /health` every 100 ms;

and checks that every concurrent stream equals its request alone (text,
finish reason, and each token's logprob and bytes). Reports the aggregate
and per-stream tokens/s of each phase, the slowest `/health` answer under
load, and the server's peak RSS (VmHWM) against the budget the plan
resolved. Requests mix greedy and seeded sampling, stop strings and
lengths; prompts are short chat messages (a synthetic container's byte
tokenizer takes any text). Exit status 1 when a stream differs.

Only the standard library; loopback only; at most 64 clients and 4096
tokens a request.
"""

import argparse
import http.client
import json
import subprocess
import sys
import threading
import time


def request(i, max_tokens):
    topics = ["rivers", "the weather", "numbers", "a city", "birds", "a story", "json", "trees"]
    body = {
        "messages": [{"role": "user", "content": f"client {i}: tell me about {topics[i % len(topics)]}"}],
        "max_tokens": max_tokens - (i % 3) * (max_tokens // 4),
        "stream": True,
        "logprobs": True,
        "temperature": 0.0 if i % 2 == 0 else 0.8,
        "seed": 100 + i,
    }
    if i % 4 == 1:
        body["stop"] = ["\n\n"]
    return body


def stream(port, body):
    """One streamed chat completion: (text, finish, [(logprob, bytes)], tokens, seconds)."""
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"status {r.status}: {r.read()[:300]!r}")
    text, finish, lps = [], None, []
    for raw in r:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        d = line[6:]
        if d == "[DONE]":
            break
        v = json.loads(d)
        ch = v["choices"][0]
        text.append(ch.get("delta", {}).get("content") or "")
        for e in (ch.get("logprobs") or {}).get("content") or []:
            lps.append((e["logprob"], e["bytes"]))
        finish = ch.get("finish_reason") or finish
    c.close()
    return "".join(text), finish, lps, len(lps), time.perf_counter() - t0


def health(port):
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("GET", "/health")
    ok = c.getresponse().status == 200
    c.close()
    return ok, time.perf_counter() - t0


def peak_rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waste", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--budget", default=None)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not (1 <= a.clients <= 64 and 1 <= a.max_tokens <= 4096 and 1 <= a.rounds <= 100):
        sys.exit("--clients 1..64, --max-tokens 1..4096, --rounds 1..100")
    extra = ["--ctx", str(a.ctx), "--parallel", str(a.parallel), "--max-queue", str(max(64, a.clients))]
    if a.budget:
        extra += ["--budget", a.budget]
    plan_args = [a.waste, "plan", a.model, "--json", "--ctx", str(a.ctx), "--parallel", str(a.parallel)]
    plan = json.loads(subprocess.run(plan_args + (["--budget", a.budget] if a.budget else []),
                                     capture_output=True, text=True).stdout)
    srv = subprocess.Popen([a.waste, "serve", a.model, "--host", "127.0.0.1", "--port", "0", *extra],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = srv.stdout.readline()
        if "http://" not in line:
            sys.exit(f"the server did not start: {line}{srv.stderr.read()}")
        port = int(line.strip().rsplit(":", 1)[1])
        bodies = [request(i, a.max_tokens) for i in range(a.clients)]
        t0 = time.perf_counter()
        alone = [stream(port, b) for b in bodies]
        alone_s = time.perf_counter() - t0
        out = {"clients": a.clients, "parallel": a.parallel, "max_tokens": a.max_tokens, "ctx": a.ctx,
               "budget_bytes": plan.get("budget_bytes"), "plan_floor_bytes": plan.get("floor_bytes"),
               "alone_tok_per_s": sum(x[3] for x in alone) / alone_s, "rounds": []}
        differ = 0
        for rnd in range(a.rounds):
            lat, stop = [], threading.Event()

            def poll():
                while not stop.is_set():
                    ok, s = health(port)
                    lat.append(s if ok else float("inf"))
                    time.sleep(0.1)

            got = [None] * a.clients
            poller = threading.Thread(target=poll)
            poller.start()
            t0 = time.perf_counter()

            def client(i):
                got[i] = stream(port, bodies[i])

            ts = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            wall = time.perf_counter() - t0
            stop.set()
            poller.join()
            bad = [i for i in range(a.clients) if got[i] is None or got[i][:3] != alone[i][:3]]
            differ += len(bad)
            out["rounds"].append({
                "tok_per_s": sum(g[3] for g in got if g) / wall,
                "tok_per_s_per_stream": sorted(g[3] / g[4] for g in got if g)[a.clients // 2],
                "wall_seconds": wall, "health_checks": len(lat), "health_max_seconds": max(lat) if lat else None,
                "streams_differing": bad,
            })
        out["peak_rss_bytes"] = peak_rss(srv.pid)
        if out["budget_bytes"] and out["peak_rss_bytes"]:
            out["peak_rss_over_budget"] = out["peak_rss_bytes"] / out["budget_bytes"]
        out["all_equal_alone"] = differ == 0
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    text = json.dumps(out, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    sys.exit(0 if differ == 0 else 1)


if __name__ == "__main__":
    main()
