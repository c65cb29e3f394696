"""Dynamic shapes for dynamo regions: one capture serves every sequence length and batch size.

A :class:`~.dynamo.DynamoRegion` compiles with ``dynamic=True``, so the sizes of the tensors
its forward is called with are symbols from the first call. A size of 0 or 1 at the first call
is specialized by dynamo (a later size captures once more, then is dynamic): dynamo's
size-oblivious mode would keep it a symbol, but then hands ``F.scaled_dot_product_attention``
a symbolic ``is_causal`` (transformers computes it from the length), a graph break per
attention. Where the model's code needs an exact size (a ``view`` with a literal shape, a
branch on a length), dynamo specializes that dimension and guards on it: :func:`static_inputs`
finds those, and the region says once which inputs and dimensions a new size will capture
again.

Sizes are values of their own in a dynamic graph (``s0 * 2``, ``x.size(1)``); they are no
sites (:func:`is_size`), so a graph names its tensors as the same graph captured with static
shapes does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)


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
    if isinstance(dim, torch.SymInt):
        expr = dim.node.expr
        return bool(dim.node.shape_env.replace(expr).is_number)
    return True


def static_inputs(gm: fx.GraphModule, key: str, fixed: set[int]
                  ) -> list[tuple[str, tuple[int, ...]]]:
    """The inputs of the region's forward in ``gm`` (placeholders whose ``node.meta[key]``
    is the parameter's name) whose dimensions dynamo specialized: (name, dims), in order.
    A dimension of a size in ``fixed`` (the sizes of the module's parameters and buffers: the
    features a weight reads, the channels of a convolution) is the model's own, not one that
    varies between calls: not reported; nor is a size of 0 or 1, which dynamo specializes
    at the first call whatever the code."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or not isinstance(node.meta.get(key), str):
            continue
        value = node.meta.get("example_value")
        shape: Sequence[Any] = getattr(value, "shape", ())
        if not isinstance(value, torch.Tensor):
            continue
        dims = tuple(i for i, d in enumerate(shape)
                     if _static(d) and int(d) > 1 and int(d) not in fixed)
        if dims:
            out.append((str(node.meta[key]), dims))
    return out
