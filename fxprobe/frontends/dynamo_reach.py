"""What torch dynamo can name in a model, decided from the module tree before any capture.

A site that dynamo finds is named after the module tree (``frontends.dynamo_names``): a module
call by the module's path (``model.layers.0.mlp``), an op by its enclosing module's path and
the op (``model.layers.0.add``), repeats with a ``_N`` suffix, and, where the model has a
list of repeated blocks holding an attention, by canonical names (``blocks.0.resid_post``,
``frontends.canonical``). Only the op part is unknown until the capture, and it is one
identifier. So a glob that can match no string of the forms::

    <module path>    <module path>_<N>    <module path>.<identifier>    (an identifier alone:
                                                                         the model's own code)

nor any canonical name the model's family can have, nor a site fx and hooks already know, can
never match, and a module type of which the model holds no instance selects nothing: both are
decided here, at ``tap()``, instead of after the first (long) capture. Everything else (an op
name, a function, a regex, a predicate) waits for the capture, as before.

The answer errs one way only: "cannot match" is said only when no site dynamo could name
matches (:meth:`Reach.could_match` returns None when the tree does not decide).
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import re
import sys
import tokenize
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from ..core.names import closest, likeness
from ..core.select import Selector
from .canonical import VOCABULARY

_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_SEPARATORS = frozenset("._")
_ATTENTION = re.compile(r"softmax|scaled_dot_product|attention|attn|attend|sdpa|flash|flex",
                        re.IGNORECASE)

# A glob as tokens: a literal character, "?" (any one), "*" (any run), or a class (a test).
_Token = tuple[str, object]


@functools.lru_cache(maxsize=256)
def _tokens(pattern: str) -> tuple[_Token, ...]:
    """``pattern`` as fnmatch reads it (``*``, ``?``, ``[seq]``, ``[!seq]``; a ``[`` that
    closes nowhere is literal)."""
    out: list[_Token] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            if not out or out[-1][0] != "*":
                out.append(("*", None))
        elif c == "?":
            out.append(("?", None))
        elif c == "[":
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            j = pattern.find("]", j)
            if j < 0:
                out.append(("c", "["))
            else:
                out.append(("[", re.compile(fnmatch.translate(pattern[i - 1:j + 1]))))
                i = j + 1
        else:
            out.append(("c", c))
    return tuple(out)


def _accepts(token: _Token, ch: str) -> bool:
    kind, arg = token
    if kind == "c":
        return arg == ch
    if kind == "[":
        return arg.match(ch) is not None  # type: ignore[attr-defined]
    return True  # "?" and "*"


def _closure(tokens: Sequence[_Token], states: Iterable[int]) -> frozenset[int]:
    """The glob positions reachable by letting each ``*`` match nothing."""
    out = set(states)
    todo = list(out)
    while todo:
        i = todo.pop()
        if i < len(tokens) and tokens[i][0] == "*" and i + 1 not in out:
            out.add(i + 1)
            todo.append(i + 1)
    return frozenset(out)


def _step(tokens: Sequence[_Token], states: frozenset[int], ch: str) -> frozenset[int]:
    nxt = set()
    for i in states:
        if i < len(tokens) and _accepts(tokens[i], ch):
            nxt.add(i if tokens[i][0] == "*" else i + 1)
    return _closure(tokens, nxt)


def _feed(tokens: Sequence[_Token], states: frozenset[int], text: str) -> frozenset[int]:
    for ch in text:
        if not states:
            break
        states = _step(tokens, states, ch)
    return states


def _word_tail(tokens: Sequence[_Token], states: frozenset[int], first: frozenset[str],
               at_least: int) -> bool:
    """Whether, from ``states``, the glob can match one character of ``first`` and then
    identifier characters (or, with ``at_least`` 0, the empty string too)."""
    end = len(tokens)
    if at_least == 0 and end in states:
        return True
    seen: set[frozenset[int]] = set()
    todo = [_closure(tokens, {j for i in states for j in _next(tokens, i, first)})]
    while todo:
        now = todo.pop()
        if not now or now in seen:
            continue
        seen.add(now)
        if end in now:
            return True
        todo.extend(_step(tokens, now, ch) for ch in _WORD)
    return False


def _next(tokens: Sequence[_Token], i: int, chars: frozenset[str]) -> set[int]:
    if i >= len(tokens) or not any(_accepts(tokens[i], ch) for ch in chars):
        return set()
    return {i if tokens[i][0] == "*" else i + 1}


def glob_reaches(pattern: str, path: str) -> bool:
    """Whether ``pattern`` can match a name dynamo gives in the module at ``path``: the path
    itself, ``path_N``, ``path.<identifier>`` (``path.<identifier>_N``); for ``path`` ""
    (the model's own code), an identifier."""
    tokens = _tokens(pattern)
    start = _closure(tokens, {0})
    if not path:
        return _word_tail(tokens, start, frozenset(_WORD), 1)
    states = _feed(tokens, start, path)
    return bool(states) and (len(tokens) in states or _word_tail(tokens, states, _SEPARATORS, 1))


@dataclass(frozen=True)
class Reach:
    """The names dynamo can give in a model's dynamo regions, as far as the tree decides."""

    paths: tuple[str, ...]
    """Every module path inside a dynamo region (the regions' own included; "" for a region
    that is the whole model)."""
    types: tuple[type, ...]
    """The types of the modules of the model."""
    canonical: tuple[str, ...]
    """Every canonical name the model's family can have (empty: none)."""
    why_no_canonical: str
    """Where ``canonical`` is empty: why."""

    @classmethod
    def of(cls, root: nn.Module, regions: Sequence[str]) -> Reach:
        """The reach of the dynamo regions at ``regions`` (module paths) in ``root``."""
        paths: dict[str, None] = {}
        for region in regions:
            module = root.get_submodule(region) if region else root
            for rel, m in module.named_modules(remove_duplicate=False):
                paths[_join(region, rel)] = None
                for attr in _unregistered(m):  # dynamo names them by their source path
                    paths[_join(_join(region, rel), attr)] = None
        types = tuple({type(m): None for m in root.modules()})
        canonical, why = _canonical(root)
        return cls(tuple(paths), types, canonical, why)

    def could_match(self, sel: Selector) -> bool | None:
        """Whether ``sel`` can select a site dynamo names; None where only the capture can
        say (an op name, a function, a regex, a predicate)."""
        source = sel.source
        if isinstance(source, type) and issubclass(source, nn.Module):
            return any(issubclass(t, source) for t in self.types)
        if not isinstance(source, str):
            return None
        if any(fnmatch.fnmatchcase(c, source) for c in self.canonical):
            return True
        return any(glob_reaches(source, p) for p in self.paths)

    def nearest(self, sel: Selector, known: Iterable[str]) -> list[str]:
        """Names like ``sel``'s pattern: module paths, canonical names and known sites, with
        block indices written ``*`` where the pattern has a ``*``."""
        probe = sel.description.strip("'\"")
        names = list(dict.fromkeys([*known, *self.paths, *self.canonical]))
        paths = [p for p in self.paths if p]
        if "*" in probe:
            names = list(dict.fromkeys([*names, *(_starred(n) for n in names)]))
            paths = list(dict.fromkeys([*paths, *(_starred(p) for p in paths)]))
        head, _, tail = probe.rpartition(".")
        ops = [f"{p}.{tail}" for p in _close_paths(head, paths)
               ] if head and tail else []  # the op in the module that was probably meant
        close = closest(probe, [n for n in names if n])
        return list(dict.fromkeys([*ops, *close]))[:5]


def _close_paths(head: str, paths: Sequence[str]) -> list[str]:
    """The two paths most like ``head``; a head that starts with ``*.`` compared with the
    same number of trailing parts of each path (``*.atn`` is like ``blocks.*.attn``)."""
    if head.startswith("*."):
        k = head.count(".")
        scored = [(likeness(head[2:], ".".join(p.split(".")[-k:])),
                   "*." + ".".join(p.split(".")[-k:])) for p in paths if p.count(".") >= k - 1]
    else:
        scored = [(likeness(head, p), p) for p in paths]
    best = sorted({t for t in scored if t[0] >= 0.6}, key=lambda t: -t[0])
    return [p for _, p in best[:2]]


def _starred(name: str) -> str:
    """``name`` with its block indices written ``*`` (``h.0.attn`` -> ``h.*.attn``)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a and b else a or b


def _unregistered(m: nn.Module) -> list[str]:
    """Modules held in a plain attribute (or a list, tuple or dict in one) of ``m`` that are
    not its submodules: dynamo reaches their code and names it by the attribute."""
    out: list[str] = []
    for name, value in vars(m).items():
        if name.startswith("__") or name in ("_modules", "_parameters", "_buffers"):
            continue
        items: Iterable[tuple[str, object]] = ()
        if isinstance(value, nn.Module):
            items = [(name, value)]
        elif isinstance(value, (list, tuple)):
            items = [(f"{name}.{i}", v) for i, v in enumerate(value)]
        elif isinstance(value, dict):
            items = [(f"{name}.{k}", v) for k, v in value.items()]
        out.extend(path for path, v in items if isinstance(v, nn.Module))
    return out


def _canonical(root: nn.Module) -> tuple[tuple[str, ...], str]:
    """The canonical names ``root`` can have: those of every list of repeated blocks (distinct
    modules of one class) whose code may compute an attention, under every prefix
    ``frontends.canonical`` may give a stack; and why there are none, where none."""
    stacks = [(p, len(m)) for p, m in root.named_modules()
              if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0
              and len({type(b) for b in m}) == 1 and len({id(b) for b in m}) == len(m)]
    if not stacks:
        return (), (f"{type(root).__name__} holds no list of repeated blocks (an "
                    "nn.ModuleList of distinct modules of one class), so it has no canonical "
                    "names")
    attending = [(p, n) for p, n in stacks
                 if _may_attend(next(iter(root.get_submodule(p).children())))]
    if not attending:
        return (), (f"the blocks of {type(root).__name__} ({', '.join(p for p, _ in stacks[:3])})"
                    " compute no attention (no softmax or scaled_dot_product_attention in "
                    "their code), so it has no canonical names")
    names: dict[str, None] = {"logits": None}
    for path, n in attending:
        for pre in ("", "encoder.", "decoder.", path + "."):
            for entry in VOCABULARY:
                for i in range(n) if "{L}" in entry else (0,):
                    names[pre + entry.format(L=i)] = None
    return tuple(names), ""


def _may_attend(block: nn.Module) -> bool:
    """Whether the code of ``block`` (the files that define its modules' classes) may compute
    an attention: an identifier there names one. Only its absence is taken as an answer."""
    files: dict[str, None] = {}
    for m in block.modules():
        for klass in type(m).__mro__:
            if klass in (nn.Module, object):
                continue
            mod = sys.modules.get(klass.__module__)
            path = getattr(mod, "__file__", None)
            if path is None:
                return True  # code fxprobe cannot read: it may attend
            files[path] = None
    if any(_names_attention(path) for path in files):
        return True
    return not files or _source_missing(block)


@functools.lru_cache(maxsize=64)
def _names_attention(path: str) -> bool:
    """Whether the code of the file at ``path`` names an attention (its identifiers, not its
    comments or strings); an unreadable file may."""
    try:
        with open(path, "rb") as f:
            toks = list(tokenize.tokenize(f.readline))
    except (OSError, SyntaxError, tokenize.TokenError):
        return True
    return any(t.type == tokenize.NAME and _ATTENTION.search(t.string) for t in toks)


def _source_missing(block: nn.Module) -> bool:
    try:
        inspect.getsource(type(block).forward)
    except (OSError, TypeError):
        return True
    return False
