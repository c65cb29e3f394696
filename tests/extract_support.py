"""What test_extract_return_nodes, test_extract share."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map

TRACEABLE = ["resnet", "encoder", "lstm", "shared", "multi_io", "train_eval", "inplace"]


def _clone(value: Any) -> Any:
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, value)


def assert_same(a: Any, b: Any) -> None:
    """Bitwise equality of tensors inside equal nests of tuples, lists and dicts."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


class _CloningInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: list[Any] = []

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op != "output":
            self.values.append(_clone(out))
        return out


def node_values(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Every node's value as produced, in graph order, from a stock fx trace."""
    interp = _CloningInterpreter(fx.symbolic_trace(model))
    with torch.no_grad():
        interp.run(*args, *kwargs.values())
    return interp.values

