"""jinja2 set up as transformers' apply_chat_template sets it up (trim_blocks,
lstrip_blocks, loop controls, `tojson` = json.dumps(ensure_ascii=False),
`raise_exception`), shared by the chat-template fixture scripts
(k3_template/render.py, k2_template/render.py).

    load(path, mutable=False) -> (template, sha256 of its source, file name)

`mutable`: jinja2's mutable sandbox instead of transformers' immutable one
(a template that appends to a list needs it; llama.cpp's engine allows it).
"""
import hashlib
import json
import os

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment


def raise_exception(msg):
    raise jinja2.exceptions.TemplateError(msg)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def load(path, mutable=False):
    src = open(path, encoding="utf-8").read()
    cls = SandboxedEnvironment if mutable else ImmutableSandboxedEnvironment
    env = cls(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(src), hashlib.sha256(src.encode()).hexdigest(), os.path.basename(path)
