"""Expected token ids for corpus.json from Python tiktoken (the oracle),
with the real o200k_base ranks (testdata/tokenizers) and both
o200k's and Kimi's patterns. Writes expected.json."""
import base64
import json
import os
import sys

import tiktoken

O200K = [
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]
def no_han(r):
    return (r.replace(r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]")
             .replace(r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"))
PATTERNS = {"o200k": "|".join(O200K), "kimi": "|".join([r"[\p{Han}]+"] + [no_han(r) for r in O200K])}

here = os.path.dirname(os.path.abspath(__file__))
ranks_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "../../../testdata/tokenizers/o200k_base.tiktoken")
ranks = {}
with open(ranks_path, "rb") as f:
    for line in f:
        if line.strip():
            t, r = line.split()
            ranks[base64.b64decode(t)] = int(r)
corpus = json.load(open(os.path.join(here, "corpus.json"), encoding="utf-8"))
out = {"_": "token ids from tiktoken " + tiktoken.__version__ + " (encode_ordinary) with o200k_base ranks; made by tools/oracle/tokenizer/expected.py",
       "patterns": PATTERNS}
for name, pat in PATTERNS.items():
    enc = tiktoken.Encoding(name, pat_str=pat, mergeable_ranks=ranks, special_tokens={})
    out[name] = [enc.encode_ordinary(s) for s in corpus]
with open(os.path.join(here, "expected.json"), "w") as f:
    json.dump(out, f, separators=(",", ":"))
print("wrote", sum(len(x) for x in out["o200k"]), "o200k ids")
