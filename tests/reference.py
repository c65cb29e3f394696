"""Independent references for the tests: eager outputs and values cloned by forward hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map


def clone(v: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, v)


def hook_values(model: nn.Module, paths: list[str], *args: Any, **kwargs: Any
                ) -> tuple[Any, dict[str, Any]]:
    """Run the model eagerly, cloning each module's output at call time (calls 2.. get _1..)."""
    seen: dict[str, Any] = {}
    counts: dict[str, int] = {}
    handles = []
    for path in paths:
        def hook(m: nn.Module, a: Any, out: Any, path: str = path) -> None:
            n = counts.get(path, 0)
            counts[path] = n + 1
            seen[f"{path}_{n}" if n else path] = clone(out)
            return None

        handles.append(model.get_submodule(path).register_forward_hook(hook))
    try:
        out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return out, seen


def hooked(model: nn.Module, call: Callable[[], Any],
           edits: dict[str, Callable[[Any], Any]] | None = None, keep: tuple[str, ...] = ()
           ) -> tuple[Any, dict[str, list[torch.Tensor]]]:
    """``call()`` on the untapped model with forward hooks editing (``edits``: each named
    module's output replaced by ``fn(output)``) and cloning (``keep``: every call's output, in
    order) the outputs of the named modules; the hooks removed after."""
    kept: dict[str, list[torch.Tensor]] = {n: [] for n in keep}
    handles = [model.get_submodule(n).register_forward_hook(
        lambda m, a, out, fn=fn: fn(out)) for n, fn in (edits or {}).items()]
    handles += [model.get_submodule(n).register_forward_hook(
        lambda m, a, out, n=n: kept[n].append(out.detach().clone())) for n in keep]
    try:
        return call(), kept
    finally:
        for h in handles:
            h.remove()


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of two nests of tensors (and equal non-tensor leaves)."""
    la, lb = tree_leaves(a), tree_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def model_state(model: nn.Module) -> dict[str, Any]:
    """Everything about a model that tapping must leave alone."""
    return {
        "training": [(n, m.training) for n, m in model.named_modules()],
        "hooks": [
            (n, k, len(getattr(m, k)))
            for n, m in model.named_modules()
            for k in sorted(vars(m))
            if "hook" in k and isinstance(getattr(m, k), dict)
        ],
        "modules": [(n, id(m), type(m)) for n, m in model.named_modules()],
        "params": [(n, id(p), p.detach().clone()) for n, p in model.named_parameters()],
        "buffers": [(n, b.clone()) for n, b in model.named_buffers()],
        "dict_keys": [(n, sorted(vars(m))) for n, m in model.named_modules()],
    }


def states_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for key in a:
        if key in ("params", "buffers"):
            if [x[:-1] for x in a[key]] != [x[:-1] for x in b[key]]:
                return False
            if not all(torch.equal(x[-1], y[-1]) for x, y in zip(a[key], b[key], strict=True)):
                return False
        elif a[key] != b[key]:
            return False
    return True
