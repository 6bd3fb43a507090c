#!/usr/bin/env python3
"""Cache-policy study on a routing trace (docs/LEARNED.md, issue 15).

Usage: policy_study.py [TRACE.jsonl] [EXPERTS_PER_LAYER]

Replays the trace (the `waste cachesim` format) through policies written
here in Python for quick exploration — Belady (with and without bypass),
LRU, LFRU, LFU with admission, LRFU (decayed recency-frequency, with and
without bypass), ExpDist (expected distance to next use: the engine's `eta`)
— and a *calibrated ceiling*: the expected-distance rule with each expert's
reuse probability read from a table of (used in the last 1/2/3 tokens,
use-count bucket) → measured P(used next token), computed on the same
trace (so it is an optimistic bound for policies that see only the access
history). A layer-step's experts are pinned together, as in the engine.
The Rust policies (`waste cachesim`) are the ones that count; this script
is how the candidates were compared.
"""
import json, sys, math, collections, random
import os
TRACE=sys.argv[1] if len(sys.argv)>1 else os.path.join(os.path.dirname(__file__),'../../testdata/routing/kimi-linear-48b-300tok.jsonl')
tr=[json.loads(l)["layers"] for l in open(TRACE) if l.strip()]
L=len(tr[0]); K=max(len(x) for t in tr for x in t); E=int(sys.argv[2]) if len(sys.argv)>2 else 256
acc=[]  # (tok, layer, expert)
for t,tok in enumerate(tr):
    for l,ids in enumerate(tok):
        for e in ids: acc.append((t,l,e))
print("accesses",len(acc),"distinct",len(set((l,e) for _,l,e in acc)))
# next use
nxt=[None]*len(acc); seen={}
for i in range(len(acc)-1,-1,-1):
    k=(acc[i][1],acc[i][2]); nxt[i]=seen.get(k,1<<60); seen[k]=i

def run(slots, policy):
    # policy: object with methods: hit(k,i), admit(k,i)->bool, victim(cands,i)->k, insert(k,i), evict(k)
    res=set(); hits=0; i=0
    for t,tok in enumerate(tr):
        for l,ids in enumerate(tok):
            pinned=set((l,e) for e in ids)
            for e in ids:
                k=(l,e)
                policy.access(k,i,t)
                if k in res:
                    hits+=1; policy.hit(k,i,t)
                else:
                    cap = slots - (K if policy.bypass else 0)
                    if len(res)<cap:
                        res.add(k); policy.insert(k,i,t)
                    else:
                        cands=[x for x in res if x not in pinned]
                        v=policy.victim(cands,i,t,k)
                        if v is not None:
                            res.remove(v); policy.evict(v); res.add(k); policy.insert(k,i,t)
                        # else bypass
                i+=1
    return hits/len(acc)

class Base:
    bypass=False
    def access(s,k,i,t): pass
    def hit(s,k,i,t): pass
    def insert(s,k,i,t): pass
    def evict(s,k): pass

class Belady(Base):
    def __init__(s): s.nu={}
    def access(s,k,i,t): s.nu[k]=nxt[i]
    def victim(s,c,i,t,k): return max(c,key=lambda x:s.nu[x])
class BeladyBypass(Belady):
    bypass=True
    def victim(s,c,i,t,k):
        v=max(c,key=lambda x:s.nu[x])
        return v if s.nu[v]>s.nu[k] else None
class LRU(Base):
    def __init__(s): s.last={}
    def access(s,k,i,t): s.last[k]=i
    def victim(s,c,i,t,k): return min(c,key=lambda x:s.last[x])
class LFRU(Base):
    def __init__(s): s.f=collections.Counter(); s.last={}
    def access(s,k,i,t): s.f[k]+=1; s.last[k]=i
    def victim(s,c,i,t,k): return min(c,key=lambda x:(s.f[x],s.last[x]))
class LRFU(Base):
    # combined recency-frequency: crf = sum 2^(-lam*(t - t_j)) in tokens
    def __init__(s,lam,bypass=False,adm=1.0): s.lam=lam; s.c={}; s.tl={}; s.bypass=bypass; s.adm=adm
    def val(s,k,t):
        if k not in s.c: return 0.0
        return s.c[k]*2**(-s.lam*(t-s.tl[k]))
    def access(s,k,i,t):
        s.c[k]=s.val(k,t)+1; s.tl[k]=t
    def victim(s,c,i,t,k):
        v=min(c,key=lambda x:s.val(x,t))
        if s.bypass and s.val(v,t) >= s.adm*s.val(k,t): return None
        return v
class LFUadm(Base):
    # LFU with full history + admission (bypass if new freq <= victim freq)
    def __init__(s,bypass=True): s.f=collections.Counter(); s.last={}; s.bypass=bypass
    def access(s,k,i,t): s.f[k]+=1; s.last[k]=i
    def victim(s,c,i,t,k):
        v=min(c,key=lambda x:(s.f[x],s.last[x]))
        if s.bypass and (s.f[v],s.last[v])>(s.f[k],0) : return None
        return v
A=L*K
class ExpDist(Base):
    """evict the key with the largest expected accesses until its next use"""
    def __init__(s, half, prior=0.02, bypass=False, mix=None):
        s.g=0.5**(1/half); s.c={}; s.tl={}; s.prior=prior; s.bypass=bypass; s.mix=mix
        s.cur=(0,0)
    def rate(s,k,t):
        c=s.c.get(k,0.0)*s.g**(t-s.tl.get(k,t))
        p=(c+ s.prior)*(1-s.g)
        return min(max(p,1e-6),1.0)
    def dist(s,k,t,l_now):
        l=k[0]
        first = (l-l_now)*K if l>l_now else (L-l_now+l)*K
        p=s.rate(k,t)
        return first + (1/p-1)*A
    def access(s,k,i,t):
        c=s.c.get(k,0.0)*s.g**(t-s.tl.get(k,t))
        s.c[k]=c+1; s.tl[k]=t; s.cur=(t,k[0])
    def victim(s,c,i,t,k):
        l_now=k[0]
        v=max(c,key=lambda x:s.dist(x,t,l_now))
        if s.bypass:
            # incoming key: its next use from now (after this access)
            if s.dist(v,t,l_now) <= s.dist(k,t,l_now): return None
        return v
T=len(tr)
used=[set() for _ in range(T)]
for t,l,e in acc: used[t].add((l,e))
keys=set(k for t in range(T) for k in used[t])
# features at end of token t for key k: (in used[t], in used[t-1], in used[t-2], min(count_so_far//4, 6))
def feats(k,t,cnt):
    return (k in used[t], t>0 and k in used[t-1], t>1 and k in used[t-2], min(cnt//3,8))
num=collections.Counter(); den=collections.Counter()
cnt=collections.Counter()
for t in range(T-1):
    for k in used[t]: cnt[k]+=1
    for k in keys:
        if cnt[k]==0: continue
        f=feats(k,t,cnt[k]); den[f]+=1; num[f]+= k in used[t+1]
table={f:num[f]/den[f] for f in den}
print(sorted(table.items(), key=lambda x:-x[1])[:10])
class Oracle(Base):
    def __init__(s): s.cnt=collections.Counter(); s.t=0
    def p(s,k,t):
        # features as of end of the previous token (t-1) for keys; approx
        c=s.cnt[k]
        if c==0: return 1e-4
        f=(k in used[t-1] if t>0 else False, t>1 and k in used[t-2], t>2 and k in used[t-3], min(c//3,8))
        # crude: if key already used in this token (layer passed), it's in used[t] for next token
        return max(table.get(f,1e-3),1e-4)
    def access(s,k,i,t):
        s.cnt[k]+=1
    def victim(s,c,i,t,k):
        l_now=k[0]
        def dist(x):
            l=x[0]
            if l<=l_now:  # next chance token t+1; use features at end of t
                f=(x in used[t] , x in used[t-1] if t>0 else False, t>1 and x in used[t-2], min(s.cnt[x]//3,8))
                p=max(table.get(f,1e-3),1e-4); first=(L-l_now+l)*K
            else:
                p=s.p(x,t); first=(l-l_now)*K
            return first+(1/p-1)*A
        return max(c,key=dist)

if __name__=="__main__":
    n=L*E
    print("| cache | slots | Belady | Belady+bypass | LRU | LFRU | LFU+admission | LRFU λ=0.05 | LRFU λ=0.2 | ExpDist h=2 | ExpDist h=5 (eta) | ExpDist h=5 +bypass | ExpDist h=20 | calibrated ceiling |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for frac in [0.03,0.06,0.125,0.25]:
        slots=int(round(frac*n)); b=run(slots,Belady())
        cells=[]
        for p in [BeladyBypass(),LRU(),LFRU(),LFUadm(),LRFU(0.05),LRFU(0.2),ExpDist(2),ExpDist(5),ExpDist(5,bypass=True),ExpDist(20),Oracle()]:
            h=run(slots,p); cells.append(f"{h:.3f} ({h/b*100:.0f}%)")
        print(f"| {frac*100:g}% | {slots} | {b:.3f} | "+" | ".join(cells)+" |"); sys.stdout.flush()
