"""Selectors: what a user asks to tap.

One primitive, :func:`where`, wraps a predicate on :class:`~fxprobe.Site`; every other selector
(a module type, a function, a glob, a regex, a module of the model) is turned into one by
:func:`as_selector`.
Selectors compose with ``|``, ``&`` and ``~``.
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn

from .errors import SelectorError, SelectorTypeError
from .names import closest
from .ops import describe_function, op_key
from .site import Site


class Selector:
    """A predicate on sites, with a description used in error messages."""

    __slots__ = ("_predicate", "description", "source", "strict")

    def __init__(self, predicate: Callable[[Site], bool], description: str,
                 strict: bool = False, source: Any = None) -> None:
        self._predicate = predicate
        self.description = description
        self.strict = strict
        """A name pattern: matching nothing is a typo, even beside other selectors."""
        self.source = source
        """What a glob or module-type selector was made from (the pattern, the class), for
        checks made before any site is known; None for the others."""

    def __call__(self, site: Site) -> bool:
        return bool(self._predicate(site))

    def __or__(self, other: Any) -> Selector:
        o = as_selector(other)
        return Selector(lambda s: self(s) or o(s), f"({self.description} | {o.description})",
                        self.strict and o.strict)

    def __ror__(self, other: Any) -> Selector:
        return as_selector(other) | self

    def __and__(self, other: Any) -> Selector:
        o = as_selector(other)
        return Selector(lambda s: self(s) and o(s), f"({self.description} & {o.description})")

    def __rand__(self, other: Any) -> Selector:
        return as_selector(other) & self

    def __invert__(self) -> Selector:
        return Selector(lambda s: not self(s), f"~{self.description}")

    def __repr__(self) -> str:
        return f"Selector({self.description})"


def where(predicate: Callable[[Site], bool], description: str | None = None) -> Selector:
    """Select the sites for which ``predicate(site)`` is true.

    Args:
        predicate: a function of a :class:`~fxprobe.Site` returning a bool.
        description: how error messages name this selector (defaults to the function's name).

    Example:
        >>> sel = fxprobe.where(lambda s: s.how == "fx" and "attn" in s.name)
    """
    if not callable(predicate):
        raise SelectorTypeError(
            f"fxprobe.where() needs a callable taking a Site, got {type(predicate).__name__}"
        )
    return Selector(predicate, description or f"where({getattr(predicate, '__name__', 'fn')})")


def module_type(cls: type[nn.Module]) -> Selector:
    """Select calls of modules that are instances of ``cls`` (traced through or not); where
    no Python class is at hand (TorchScript, torch.export), calls of the class of that name."""
    qualname = f"{cls.__module__}.{cls.__qualname__}"
    return Selector(
        lambda s: s.kind == "call_module" and (
            issubclass(s.module_type, cls) if s.module_type is not None
            else s.type_name == qualname),  # TorchScript/export: the class is not at hand
        cls.__name__, source=cls,
    )


def function(fn: Callable[..., Any]) -> Selector:
    """Select every spelling of an op: ``torch.add`` also matches ``x + y`` and ``x.add(y)``;
    ``F.relu`` also matches calls of ``nn.ReLU`` modules (every stateless ``torch.nn`` module
    with a functional twin)."""
    key = op_key(fn)
    desc = describe_function(fn)
    if key is None:
        return where(lambda s: s.kind == "call_function" and s.target is fn, desc)
    return where(lambda s: s.op_key == key and s.kind != "placeholder", desc)


def glob(pattern: str) -> Selector:
    """Select sites whose name, or one of their canonical names (``Site.canonical``:
    ``"blocks.*.resid_post"``), matches a shell-style pattern (``"layer1.*.add"``)."""
    return Selector(lambda s: any(fnmatch.fnmatchcase(n, pattern) for n in names_of(s)),
                    repr(pattern), strict=True, source=pattern)


def regex(pattern: re.Pattern[str]) -> Selector:
    """Select sites whose name, or one of their canonical names, contains a match of a
    compiled regular expression."""
    return Selector(lambda s: any(pattern.search(n) is not None for n in names_of(s)),
                    f"re.compile({pattern.pattern!r})", strict=True)


def module_instance(module: nn.Module, paths: Sequence[str]) -> Selector:
    """Select the calls of one module of the model (``ops=model.conv1``: the object a hook
    would be registered on), given its ``paths`` in the model (several where it is registered
    under several names).

    Raises:
        SelectorError: ``paths`` is empty: the module is not part of the model.
    """
    if not paths:
        raise SelectorError(
            f"selector {type(module).__name__}(...) is a module instance that is not part of "
            "the model being tapped (compared by identity: a copy or another model's module "
            "is another module); pass a submodule of that model (model.conv1), its path as a "
            f"string ('conv1'), or its type ({type(module).__name__})")
    where_ = frozenset(paths)
    return Selector(lambda s: s.kind == "call_module" and s.module_path in where_,
                    repr(paths[0]), strict=True)


def paths_in(model: nn.Module) -> Callable[[nn.Module], list[str]]:
    """The finder :func:`as_selector` takes for ``model``: a module's paths in it."""
    return lambda m: [p for p, x in model.named_modules(remove_duplicate=False) if x is m]


def names_of(site: Site) -> tuple[str, ...]:
    """Every name ``site`` answers to: its own, then its canonical names."""
    return (site.name, *site.canonical)


def as_selector(obj: Any, find: Callable[[nn.Module], list[str]] | None = None) -> Selector:
    """Turn anything ``ops=`` accepts into a :class:`Selector`; a module instance through
    ``find`` (its paths in the model, :func:`paths_in`), where the model is known."""
    if isinstance(obj, Selector):
        return obj
    if isinstance(obj, Site):  # a record fxprobe.sites() or tapped.sites listed: that site
        return Selector(lambda s: s.name == obj.name, repr(obj.name), strict=True)
    if isinstance(obj, str):
        return glob(obj)
    if isinstance(obj, re.Pattern):
        return regex(obj)
    if isinstance(obj, type):
        if issubclass(obj, nn.Module):
            return module_type(obj)
        raise SelectorTypeError(
            f"selector {obj.__name__!r} is a class but not an nn.Module subclass; "
            "pass a module type such as nn.Conv2d, a function such as torch.flatten, "
            "a glob string, a re.Pattern or fxprobe.where(predicate)"
        )
    if isinstance(obj, nn.Module):
        if find is not None:
            return module_instance(obj, find(obj))
        raise SelectorTypeError(
            f"selector {type(obj).__name__}(...) is a module instance, which selects only "
            "where the model is known (fxprobe.tap, tapped.intervene, tapped.run_with_cache); "
            f"pass its type ({type(obj).__name__}) or its site name as a string"
        )
    if callable(obj):
        return function(obj)
    raise SelectorTypeError(
        f"selector {obj!r} of type {type(obj).__name__} is not supported; pass a module type "
        "(nn.Conv2d), a function or operator (torch.flatten, operator.add), a glob string "
        "('layer1.*.add'), a re.Pattern, fxprobe.where(predicate), or a list of these"
    )


def as_selectors(ops: Any, find: Callable[[nn.Module], list[str]] | None = None
                 ) -> list[Selector] | None:
    """``None`` (every site), one selector, or a list/tuple/set of them (their union); module
    instances through ``find`` (see :func:`as_selector`)."""
    if ops is None:
        return None
    if isinstance(ops, (list, tuple, set, frozenset)):
        if not ops:
            raise SelectorError(
                "ops= is an empty list, which selects nothing; pass ops=None to tap every site"
            )
        return [as_selector(o, find) for o in ops]
    return [as_selector(ops, find)]


def select(sites: Sequence[Site], selectors: list[Selector] | None, *, context: str,
           fallbacks: Sequence[Any] = (),
           other_mode: Callable[[], Sequence[Site]] | None = None) -> list[Site]:
    """The sites the selectors pick, in site order.

    ``None`` picks every site but the calls of modules fx traced through (their values are
    those of other sites). A list of selectors is a union: a type or function selector in it
    may match nothing (one list serves many models) as long as the union matches something,
    but a glob or regex that matches nothing is a typo and raises. With ``other_mode``, a
    selector that matches only the other mode's sites (dropout in training) is not an error.

    Raises:
        SelectorError: naming the selector, the closest names, and the modules that ran as
            written (whose functional ops are not sites).
    """
    if selectors is None:
        return [s for s in sites if not s.inlined]
    matched = [sel for sel in selectors if any(sel(s) for s in sites)]
    missing = [sel for sel in selectors if sel not in matched]
    others: Sequence[Site] | None = None
    for sel in missing:
        if others is None and other_mode is not None:
            others = other_mode()
        if others is not None and any(sel(s) for s in others):
            continue
        if sel.strict or len(selectors) == 1 or not matched:
            raise SelectorError(no_match_message(sel, sites, context, fallbacks))
    return [s for s in sites if any(sel(s) for sel in matched)]


def select_ops(sites: Sequence[Site], ops: Any, *, context: str, model: nn.Module | None = None,
               fallbacks: Sequence[Any] = ()) -> list[Site]:
    """The sites among ``sites`` that ``ops`` (anything ``ops=`` takes, ``None``: every site)
    selects, in site order; a module instance by its paths in ``model``: the one selection
    line of every entry point that has the sites at hand (see :func:`select`)."""
    find = paths_in(model) if model is not None else None
    return select(sites, as_selectors(ops, find), context=context, fallbacks=fallbacks)


def _may_hide(probe: str, fallback: Any) -> bool:
    """Whether a module that runs as written may hold what ``probe`` (a pattern or an op name)
    names: the pattern is under its path, or its forward's source mentions the op's name."""
    path = getattr(fallback, "path", "")
    if path and (probe == path or probe.startswith(path + ".")):
        return True
    name = probe.rsplit(".", 1)[-1].strip("*()")
    if not name.isidentifier():
        return False
    try:
        source = inspect.getsource(fallback.module_type.forward)
    except (OSError, TypeError, AttributeError):
        return False
    return re.search(rf"\b{re.escape(name)}\b", source) is not None


_ATTENTION_WORDS = ("softmax", "attn_prob", "attention_prob", "attn_weight", "attention_weight",
                    "attn_drop", "attn_map")


CANONICAL = re.compile(r"^(blocks\.(\d+|\*)\.\S+|embed|pos_embed|ln_final|logits)$")
"""What a name of the canonical transformer vocabulary looks like (docs/transformers.md)."""

CANONICAL_ELSEWHERE = (
    "Canonical transformer names exist where fxprobe recognises a transformer: a model torch "
    "dynamo captured (fxprobe.tap, fxprobe.sites with an example input, tracer 'auto' or "
    "'dynamo'), or one torch.fx traced whole whose blocks (distinct modules of one class in "
    "an nn.ModuleList or nn.Sequential) each hold an attention (F.scaled_dot_product_attention, "
    "a softmax weighing values, nn.MultiheadAttention) and whose input an nn.Embedding or "
    "nn.Conv2d reads. This model is neither: its sites are named by module path and op.")
"""Why a canonical name matches nothing where no site has one."""


def no_match_message(sel: Selector, sites: Iterable[Site], context: str,
                     fallbacks: Sequence[Any] = ()) -> str:
    sites = list(sites)
    names = [n for s in sites for n in names_of(s)]
    probe = sel.description.strip("'\"")
    close = closest(probe, names)
    if not close:
        tail = probe.split(".")[-1].strip("*")
        close = [n for n in names if tail and tail in n][:5]
    hint = f" Closest site names: {', '.join(close)}." if close else ""
    sdpa = [s.name for s in sites if s.op_key == "scaled_dot_product_attention"]
    if sdpa and any(w in probe.lower() for w in _ATTENTION_WORDS):
        # The softmax is inside the fused kernel: no name spelled like it is the right answer.
        hint = (f" The model computes attention with F.scaled_dot_product_attention, whose "
                f"softmax is inside the fused op: select its sites ({', '.join(sdpa[:3])}"
                f"{' ...' if len(sdpa) > 3 else ''}: ops=F.scaled_dot_product_attention or "
                "'*.scaled_dot_product_attention'), or the probabilities themselves with "
                "ops=fxprobe.attention_probs, tracer='dynamo' (sites named "
                "'<module>.attention_probs').")
    if CANONICAL.match(probe) and not any(s.canonical for s in sites):
        hint += f" {sel.description} is a canonical transformer name. {CANONICAL_ELSEWHERE}"
    ops = sorted({s.op for s in sites if s.kind != "placeholder"})
    hidden = ""
    if fallbacks:
        likely = [f for f in fallbacks if _may_hide(probe, f)]
        ranked = likely + [f for f in fallbacks if f not in likely]
        shown = "; ".join(str(f) for f in ranked[:3])
        more = f" (and {len(fallbacks) - 3} more)" if len(fallbacks) > 3 else ""
        hidden = (f" {len(fallbacks)} module(s) run as written because torch.fx could not trace "
                  f"them, so only their submodule calls are sites, not their functional ops: "
                  f"{shown}{more}.")
        if likely:
            hidden += (f" What {sel.description} names is probably inside "
                       f"{', '.join(f.what for f in likely[:3])}: make it traceable, or select "
                       "its submodule calls (a module type or path), which hooks reach.")
    return (
        f"selector {sel.description} matches no site in {context}.{hint}{hidden} "
        f"Ops present: {', '.join(ops[:12])}{' ...' if len(ops) > 12 else ''}. "
        "Run fxprobe.sites(model) to list every site name."
    )
