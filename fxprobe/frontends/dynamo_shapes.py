"""Dynamic shapes for dynamo regions: one capture serves every sequence length and batch size.

A :class:`~.dynamo.DynamoRegion` compiles with ``dynamic=True``, so the sizes of the tensors
its forward is called with are symbols from the first call. A size of 0 or 1 at the first call
is specialized by dynamo (a later size captures once more, then is dynamic), except a batch of
one (dim 0 of an input tensor, a prompt): :func:`symbolic_batch` keeps it a symbol at the
first call, with dynamo's size-oblivious mode scoped to that call and every other size 1 kept
exact (a dim that broadcasts: the size-oblivious mode would assume it does not, and a
symbolic length of 1 would hand ``F.scaled_dot_product_attention`` a symbolic
``is_causal``). A shared block (``dynamo_blocks``) first captured inside that call keeps exact
the sizes 1 the region's trace kept (the batch of rotary embeddings). Where the model's code
needs an exact size (a ``view`` with a literal shape, a branch on a length or on a batch of
one), dynamo specializes that dimension and guards on it: :func:`static_inputs` finds those,
and the region says once which inputs and dimensions a new size will capture again.

Sizes are values of their own in a dynamic graph (``s0 * 2``, ``x.size(1)``); they are no
sites (:func:`is_size`), so a graph names its tensors as the same graph captured with static
shapes does.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sympy
import torch
import torch.fx.experimental._config as fx_config
from torch import fx, nn
from torch.utils import _pytree as pytree

_MARKS = ("_dynamo_static_indices", "_has_dynamo_dim_marking")  # mark_static's attributes
_ENTRIES: Callable[[types.CodeType], list[Any]] | None = getattr(
    torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)


UNCHECKED = object()  # a guard tree this torch cannot check from Python (serving)


def call_frame(fn: Callable[..., Any], module: nn.Module, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> dict[str, Any]:
    """The locals a call of fxprobe's region function ``fn(module, *args, **kwargs)`` starts
    with, by name, as dynamo's guards read them: the arguments and the closure's cells."""
    return {"module": module, "args": args, "kwargs": kwargs, **{
        name: cell.cell_contents for name, cell in zip(
            fn.__code__.co_freevars, fn.__closure__ or (), strict=True)}}


def serving(fn: Callable[..., Any], frame: dict[str, Any]) -> Any:
    """The cache entry of a graph dynamo compiled for ``fn`` that serves a call whose locals
    are ``frame`` (:func:`call_frame`): its guards pass, as dynamo looks it up; None where no
    entry's do; :data:`UNCHECKED` where the guards cannot be checked here."""
    if _ENTRIES is None:
        return UNCHECKED
    for entry in _ENTRIES(fn.__code__):
        try:
            if entry.guard_manager.check(frame):
                return entry
        except Exception:  # not a guard tree this torch checks so
            return UNCHECKED
    return None


def cached(fn: Callable[..., Any], frame: dict[str, Any]) -> bool:
    """Whether a graph dynamo compiled for ``fn`` serves a call whose locals are ``frame``
    (:func:`serving`); false where that cannot be checked."""
    return serving(fn, frame) not in (None, UNCHECKED)

_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)


def call_tensors(values: Any, depth: int = 3) -> list[torch.Tensor]:
    """The tensors among a call's arguments ``values``, also those an argument object holds
    (a key/value cache's keys and values), ``depth`` attributes deep; no module's."""
    out: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(values):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif depth and hasattr(leaf, "__dict__") and not isinstance(leaf, (nn.Module, type)):
            out += call_tensors(list(vars(leaf).values()), depth - 1)
    return out


def batch_of_one(values: Any, cached: Callable[[], bool]
                 ) -> contextlib.AbstractContextManager[None]:
    """:func:`symbolic_batch` for a region's call with arguments ``values``, where dynamo will
    trace it (``cached()`` is false: no graph's guards pass): where no tensor of 2 dims or
    more has a batch larger than 1 (a batch of one), dim 0 of each is a symbol; every other
    size 1 stays exact (where a batch is larger, a batch of 1 broadcasts). Only then: dynamo
    guards on the marks, and a call with marks no graph was traced with traces again."""
    tensors = call_tensors(values)
    if not any(1 in t.shape for t in tensors) or cached():
        return contextlib.nullcontext()  # nothing dynamo would specialize, or no trace
    one = all(t.shape[0] == 1 for t in tensors if t.dim() >= 2)
    return symbolic_batch(tensors, lambda i, t: set(range(
        1 if one and t.dim() >= 2 else 0, t.dim())))


@contextlib.contextmanager
def symbolic_batch(tensors: list[torch.Tensor], keep: Callable[[int, torch.Tensor], set[int]]
                   ) -> Iterator[None]:
    """While fxprobe's own compiled function runs (and traces, where its guards fail): a size
    of 1 of the ``tensors`` is a symbol like any other size (dynamo's size-oblivious mode),
    except the dims ``keep(i, t)`` names for the ``i``-th, which stay exact: so a batch of one
    (a prompt) is a symbol and a later batch of 2 reuses the graphs, while a dim that
    broadcasts stays 1. Scoped to this call: the tensors' marks are taken off after it, and a
    torch.compile of the user's own, outside it, sees dynamo's settings as they were."""
    saved = [(t, {k: t.__dict__[k] for k in _MARKS if k in t.__dict__}) for t in tensors]
    try:
        for i, t in enumerate(tensors):
            for d in (d for d in keep(i, t) if d < t.dim() and t.shape[d] == 1):
                torch._dynamo.mark_static(t, d)
        with fx_config.patch(  # type: ignore[attr-defined]
                backed_size_oblivious=True, use_duck_shape=False):
            yield
    finally:
        for t, marks in saved:  # the user's own marks as they were
            for k in _MARKS:
                t.__dict__.pop(k, None)
            t.__dict__.update(marks)


def is_size(node: fx.Node) -> bool:
    """Whether ``node`` computes a size (a symbolic int, float or bool, or a shape holding
    one), not a tensor: an op that exists in a dynamic graph only."""
    value = node.meta.get("example_value")
    if isinstance(value, _SYM):
        return True
    if isinstance(value, (tuple, list)):  # torch.Size included
        return any(isinstance(v, _SYM) for v in value)
    return False


def _static(dim: Any) -> bool:
    """Whether a size is exact in the graph: a number, or a symbol the trace guarded equal to
    one (a branch on a batch of one under :func:`symbolic_batch`)."""
    if isinstance(dim, torch.SymInt):
        expr = dim.node.expr
        env = dim.node.shape_env
        if env.replace(expr).is_number:
            return True
        return any(isinstance(g.expr, sympy.Eq) and expr in g.expr.args
                   and any(a.is_number for a in g.expr.args) for g in env.guards)
    return True


def static_inputs(gm: fx.GraphModule, key: str, fixed: set[int]
                  ) -> list[tuple[str, tuple[int, ...]]]:
    """The inputs of the region's forward in ``gm`` (placeholders whose ``node.meta[key]``
    is the parameter's name) whose dimensions dynamo specialized: (name, dims), in order.
    A dimension of a size in ``fixed`` (the sizes of the module's parameters and buffers: the
    features a weight reads, the channels of a convolution) is the model's own, not one that
    varies between calls: not reported; nor is a size of 0, or of 1 past dim 0, which dynamo
    specializes at the first call whatever the code (a batch of one is a symbol there:
    :func:`symbolic_batch`, and reported where the code guarded it)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or not isinstance(node.meta.get(key), str):
            continue
        value = node.meta.get("example_value")
        shape: Sequence[Any] = getattr(value, "shape", ())
        if not isinstance(value, torch.Tensor):
            continue
        dims = tuple(i for i, d in enumerate(shape)
                     if _static(d) and (int(d) > 1 or int(d) == 1 and i == 0)
                     and int(d) not in fixed)
        if dims:
            out.append((str(node.meta[key]), dims))
    return out
