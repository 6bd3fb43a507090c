#!/usr/bin/env python3
"""Cache-policy study on a routing trace (docs/lab/, issue 15).

Usage: policy_study.py [TRACE.jsonl] [EXPERTS_PER_LAYER]
       STUDY=general policy_study.py [...]   (ARC, LIRS, S3-FIFO, W-TinyLFU)
       STUDY=lookahead policy_study.py [...] (within-token lookahead and its ceiling)

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

# --- general-purpose policies from the literature (issue 15 asks for them).
# Each keeps its own queues; `victim` walks them in eviction order and skips
# the keys pinned by the current layer-step (those not in `c`).
from collections import OrderedDict
def first_unpinned(seq, ok):
    for x in seq:
        if x in ok: return x
    return None
class ARC(Base):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03): T1 (seen once
    recently), T2 (seen at least twice), ghosts B1/B2 steer the target p."""
    def __init__(s, slots): s.c=slots; s.p=0.0; s.t1=OrderedDict(); s.t2=OrderedDict(); s.b1=OrderedDict(); s.b2=OrderedDict()
    def hit(s,k,i,t):
        (s.t1 if k in s.t1 else s.t2).pop(k,None); s.t2[k]=1
    def victim(s,c,i,t,k):
        ok=set(c)
        if k in s.b1: s.p=min(s.c, s.p+max(len(s.b2)/max(len(s.b1),1),1))
        elif k in s.b2: s.p=max(0.0, s.p-max(len(s.b1)/max(len(s.b2),1),1))
        from_t1 = len(s.t1)>0 and (len(s.t1)>s.p or (k in s.b2 and len(s.t1)==s.p))
        order=[s.t1,s.t2] if from_t1 else [s.t2,s.t1]
        for q in order:
            v=first_unpinned(q,ok)
            if v is not None: return v
        return None
    def evict(s,v):
        if v in s.t1: s.t1.pop(v); s.b1[v]=1
        else: s.t2.pop(v,None); s.b2[v]=1
        while len(s.b1)>s.c: s.b1.popitem(last=False)
        while len(s.b2)>s.c: s.b2.popitem(last=False)
    def insert(s,k,i,t):
        if k in s.b1 or k in s.b2:
            s.b1.pop(k,None); s.b2.pop(k,None); s.t2[k]=1
        else: s.t1[k]=1
class S3FIFO(Base):
    """S3-FIFO (Yang et al., SOSP'23): a small FIFO (10%) filters one-hit
    keys, a main FIFO with re-insertion of used keys (freq capped at 3), a
    ghost FIFO of keys evicted from the small queue."""
    def __init__(s, slots, small=0.1):
        s.n=slots; s.ns=max(1,int(small*slots)); s.S=OrderedDict(); s.M=OrderedDict(); s.G=OrderedDict(); s.f={}
    def hit(s,k,i,t): s.f[k]=min(s.f.get(k,0)+1,3)
    def victim(s,c,i,t,k):
        ok=set(c)
        for _ in range(4*s.n):
            if len(s.S)>=s.ns or not s.M:
                q=s.S if s.S else s.M
            else: q=s.M
            x,_=q.popitem(last=False)
            if x not in ok: q[x]=1; continue          # pinned: to the back
            if q is s.S:
                if s.f.get(x,0)>0: s.M[x]=1; s.f[x]=0; continue   # promote
                s.G[x]=1
                while len(s.G)>s.n: s.G.popitem(last=False)
                return x
            if s.f.get(x,0)>0: s.f[x]-=1; s.M[x]=1; continue   # second chance
            return x
        return first_unpinned(list(s.S)+list(s.M), ok)
    def evict(s,v):
        s.S.pop(v,None); s.M.pop(v,None); s.f.pop(v,None)
    def insert(s,k,i,t):
        if k in s.G: s.G.pop(k); s.M[k]=1
        else: s.S[k]=1
        s.f[k]=0
class LIRS(Base):
    """LIRS (Jiang & Zhang, SIGMETRICS'02): keys with a short inter-reference
    recency (LIR, 99% of the slots) stay; the rest (HIR) pass through a
    small resident queue Q; stack S orders keys by recency, pruned so its
    bottom is LIR."""
    def __init__(s, slots, hir=0.01):
        s.lirs=max(1,slots-max(1,int(hir*slots))); s.S=OrderedDict(); s.Q=OrderedDict(); s.lir=set(); s.res=set()
    def prune(s):
        while s.S:
            x=next(iter(s.S))
            if x in s.lir: break
            s.S.pop(x)
    def ref(s,k):
        # a reference to k (hit or miss-then-insert): update S/Q and statuses
        inS = k in s.S
        if k in s.lir:
            s.S.pop(k); s.S[k]=1; s.prune(); return
        # k is HIR (resident or not)
        if inS or len(s.lir)<s.lirs:
            # promote to LIR; demote the bottom LIR of S to resident HIR
            s.S.pop(k,None); s.S[k]=1; s.Q.pop(k,None); s.lir.add(k)
            if len(s.lir)>s.lirs:
                b=next(iter(s.S)); s.S.pop(b); s.lir.discard(b); s.Q[b]=1; s.prune()
        else:
            s.S[k]=1; s.Q.pop(k,None); s.Q[k]=1
    def hit(s,k,i,t): s.ref(k)
    def victim(s,c,i,t,k):
        ok=set(c)
        v=first_unpinned(s.Q,ok)
        if v is None: v=first_unpinned(s.S,ok.intersection(s.lir))
        return v
    def evict(s,v):
        s.res.discard(v); s.Q.pop(v,None)
        if v in s.lir: s.lir.discard(v); s.S.pop(v,None); s.prune()
        # a HIR victim stays in S as a non-resident HIR (its recency is kept)
    def insert(s,k,i,t): s.res.add(k); s.ref(k)
class WTinyLFU(Base):
    """W-TinyLFU (Einziger et al., TOS'17; Caffeine's default): a window LRU
    (1%; Caffeine adapts it by hill climbing — the table also runs 50%) in front of a segmented LRU main (20% probation, 80% protected);
    a key leaving the window enters main only if a count-min sketch
    (4 rows, aged by halving every 10 x slots accesses) rates it above
    main's probation victim; otherwise the window's key is the victim."""
    def __init__(s, slots, window=0.01):
        s.nw=max(1,int(window*slots)); s.nm=slots-s.nw; s.nprot=int(0.8*s.nm)
        s.W=OrderedDict(); s.P=OrderedDict(); s.R=OrderedDict()
        s.w=max(64,4*slots); s.rows=[[0]*s.w for _ in range(4)]; s.ops=0; s.reset=10*slots
        s.seeds=[0x9E3779B1,0x85EBCA77,0xC2B2AE3D,0x27D4EB2F]
    def h(s,k,r): return (hash((k,s.seeds[r]))) % s.w
    def est(s,k): return min(s.rows[r][s.h(k,r)] for r in range(4))
    def access(s,k,i,t):
        for r in range(4):
            j=s.h(k,r)
            if s.rows[r][j]<15: s.rows[r][j]+=1
        s.ops+=1
        if s.ops>=s.reset:
            s.ops=0; s.rows=[[v//2 for v in row] for row in s.rows]
    def hit(s,k,i,t):
        if k in s.W: s.W.move_to_end(k)
        elif k in s.P:
            s.P.pop(k); s.R[k]=1
            while len(s.R)>s.nprot:
                x,_=s.R.popitem(last=False); s.P[x]=1
        else: s.R.move_to_end(k)
    def victim(s,c,i,t,k):
        ok=set(c)
        cand=first_unpinned(s.W,ok) if len(s.W)>=s.nw else None
        mv=first_unpinned(list(s.P)+list(s.R),ok)
        if cand is None: return mv if mv is not None else first_unpinned(s.W,ok)
        if mv is None: return cand
        if s.est(cand)>s.est(mv):
            # the window's key is admitted: main's victim goes
            s.W.pop(cand); s.P[cand]=1; return mv
        return cand
    def evict(s,v):
        s.W.pop(v,None); s.P.pop(v,None); s.R.pop(v,None)
    def insert(s,k,i,t):
        s.W[k]=1
        # while main has room (the cache filling up) the window spills into it
        while len(s.W)>s.nw and len(s.P)+len(s.R)<s.nm:
            x,_=s.W.popitem(last=False); s.P[x]=1

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

# --- within-token lookahead (what a router lookahead could know). `Pathway`
# learns, online from finished tokens, how often expert f of layer l follows
# expert e of layer l-d (d = 1..depth) in the same token, and replaces eta's
# reuse probability for the current token's layers still ahead by the
# average of those conditional frequencies over the experts already routed
# this token. `CurrentToken` is its ceiling: it *knows* the current token's
# remaining routing (a perfect lookahead for every layer ahead) — an expert
# ahead that the token uses is needed at its exact distance, one it does not
# use is next needed a token later at eta's estimate.
class Pathway(ExpDist):
    def __init__(s,half=5,depth=3):
        super().__init__(half); s.depth=depth
        s.co=collections.Counter(); s.n=collections.Counter(); s.lastt=-1
    def access(s,k,i,t):
        if t!=s.lastt:
            if s.lastt>=0: s.learn(tr[s.lastt])
            s.lastt=t
        super().access(k,i,t)
    def learn(s,tok):
        for l in range(L):
            for e in tok[l]:
                s.n[(l,e)]+=1
                for d in range(1,s.depth+1):
                    if l+d<L:
                        for f in tok[l+d]: s.co[(l,e,l+d,f)]+=1
    def dist(s,x,t,l_now):
        l=x[0]
        if l<=l_now: return super().dist(x,t,l_now)
        ps=[(s.co[(l-d,e,l,x[1])]+K/E)/(s.n[(l-d,e)]+1)
            for d in range(1,s.depth+1) if 0<=l-d<=l_now
            for e in tr[t][l-d] if s.n[(l-d,e)]>0]
        if not ps: return super().dist(x,t,l_now)
        p=min(max(sum(ps)/len(ps)*K,1e-6),1.0)
        return (l-l_now)*K+(1/p-1)*A
class CurrentToken(ExpDist):
    def dist(s,x,t,l_now):
        l=x[0]
        if l<=l_now: return super().dist(x,t,l_now)
        if x[1] in tr[t][l]: return (l-l_now)*K
        return (L-l_now+l)*K+(1/s.rate(x,t)-1)*A

def table(names, make):
    """One row per cache size: Belady, then each policy `make(slots)` returns, as hit rate (share of Belady)."""
    n=L*E
    print("| cache | slots | Belady | "+" | ".join(names)+" |")
    print("|---|---|---|"+"---|"*len(names))
    for frac in [0.03,0.06,0.125,0.25]:
        slots=int(round(frac*n)); b=run(slots,Belady())
        cells=[]
        for p in make(slots):
            h=run(slots,p); cells.append(f"{h:.3f} ({h/b*100:.0f}%)")
        print(f"| {frac*100:g}% | {slots} | {b:.3f} | "+" | ".join(cells)+" |"); sys.stdout.flush()

if __name__=="__main__" and os.environ.get("STUDY")=="lookahead":
    table(["eta (ExpDist h=5)","eta + pathway d=1","eta + pathway d=3","eta + the current token known"],
          lambda slots: [ExpDist(5),Pathway(depth=1),Pathway(depth=3),CurrentToken(5)])
elif __name__=="__main__" and os.environ.get("STUDY")=="general":
    # ARC, LIRS, S3-FIFO and W-TinyLFU beside LRU and eta (ExpDist h=5)
    table(["LRU","ARC","LIRS","S3-FIFO","W-TinyLFU (1% window)","W-TinyLFU (50% window)","eta (ExpDist h=5)"],
          lambda slots: [LRU(),ARC(slots),LIRS(slots),S3FIFO(slots),WTinyLFU(slots),WTinyLFU(slots,window=0.5),ExpDist(5)])
elif __name__=="__main__":
    table(["Belady+bypass","LRU","LFRU","LFU+admission","LRFU λ=0.05","LRFU λ=0.2","ExpDist h=2","ExpDist h=5 (eta)","ExpDist h=5 +bypass","ExpDist h=20","calibrated ceiling"],
          lambda slots: [BeladyBypass(),LRU(),LFRU(),LFUadm(),LRFU(0.05),LRFU(0.2),ExpDist(2),ExpDist(5),ExpDist(5,bypass=True),ExpDist(20),Oracle()])
