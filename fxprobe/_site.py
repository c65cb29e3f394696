"""``Site``: one place in a model where fxprobe can capture a value."""

from __future__ import annotations

import builtins
import operator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

How = Literal["fx", "hook", "dynamo"]


@dataclass(frozen=True)
class Site:
    """One tappable place: an fx node, or a module call reached by a hook."""

    name: str
    """Qualified site name, as torchvision's ``get_graph_node_names`` spells it."""
    how: How
    """``"fx"`` when a tap node in the traced graph captures it, ``"hook"`` for a module hook,
    ``"dynamo"`` for a node of a graph that torch dynamo captured."""
    kind: str
    """The fx node kind: placeholder, get_attr, call_module, call_function or call_method."""
    target: Any = field(compare=False)
    """Module path (call_module), function (call_function), method name (call_method)."""
    module_path: str
    """Qualified path of the called module (call_module) or of the module whose code ran it."""
    module_type: type[nn.Module] | None = field(default=None, compare=False)
    """Type of the called module for call_module sites, else None."""
    op_key: str | None = None
    """Canonical op name shared by every spelling (``add`` for ``torch.add``, ``x + y``)."""
    replaced: bool = False
    """True when a callback may replace this site's value for downstream consumers."""

    @property
    def op(self) -> str:
        """A readable name of what the site computes (``Conv2d``, ``torch.flatten``, ``.add``)."""
        if self.kind == "call_module":
            return self.module_type.__name__ if self.module_type is not None else "module"
        if self.kind == "call_function":
            return describe_function(self.target)
        if self.kind == "call_method":
            return f".{self.target}()"
        if self.kind == "placeholder":
            return "input"
        return "attribute"


_OPERATOR_KEYS = {
    operator.add: "add", operator.iadd: "add",
    operator.sub: "sub", operator.isub: "sub",
    operator.mul: "mul", operator.imul: "mul",
    operator.truediv: "div", operator.itruediv: "div",
    operator.floordiv: "floor_divide", operator.ifloordiv: "floor_divide",
    operator.mod: "remainder", operator.imod: "remainder",
    operator.pow: "pow", operator.ipow: "pow",
    operator.matmul: "matmul", operator.imatmul: "matmul",
    operator.neg: "neg", operator.pos: "positive", operator.abs: "abs",
    operator.and_: "bitwise_and", operator.iand: "bitwise_and",
    operator.or_: "bitwise_or", operator.ior: "bitwise_or",
    operator.xor: "bitwise_xor", operator.ixor: "bitwise_xor",
    operator.invert: "bitwise_not",
    operator.lshift: "bitwise_left_shift", operator.rshift: "bitwise_right_shift",
    operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le",
    operator.gt: "gt", operator.ge: "ge",
    operator.getitem: "getitem", operator.setitem: "setitem",
}
_METHOD_ALIASES = {
    "truediv": "div", "true_divide": "div", "floordiv": "floor_divide", "mod": "remainder",
    "multiply": "mul", "subtract": "sub", "divide": "div", "absolute": "abs",
    "negative": "neg", "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
    "invert": "bitwise_not", "lshift": "bitwise_left_shift", "rshift": "bitwise_right_shift",
}


def _normalize(name: str) -> str:
    """``__iadd__`` -> ``add``, ``relu_`` -> ``relu``, ``__rmul__`` -> ``mul``."""
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith(("i", "r")) and name[1:] in _DUNDER_BASES:
            name = name[1:]
    elif name.endswith("_") and not name.startswith("_"):
        name = name[:-1]
    return _METHOD_ALIASES.get(name, name)


_DUNDER_BASES = {
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
    "lshift", "rshift",
}


def is_torch_callable(fn: Any) -> bool:
    """True for functions and methods that belong to torch (``torch.add``, ``F.gelu``)."""
    objclass = getattr(fn, "__objclass__", None)
    if objclass is not None and isinstance(objclass, type) and issubclass(objclass, torch.Tensor):
        return True
    if objclass is not None and objclass.__name__ == "TensorBase":
        return True
    module = getattr(fn, "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")


def op_key(fn: Any) -> str | None:
    """The canonical op name of a function, or None if it has no torch-wide identity."""
    if fn in _OPERATOR_KEYS:
        return _OPERATOR_KEYS[fn]
    if is_torch_callable(fn):
        name = getattr(fn, "__name__", None)
        return _normalize(name) if name else None
    return None


def method_key(name: str) -> str:
    """The canonical op name of a tensor method call ``x.<name>(...)``."""
    return _normalize(name)


def describe_function(fn: Any) -> str:
    """``torch.flatten``, ``operator.add``, ``torch.nn.functional.relu``, ``my_fn``."""
    if fn in _OPERATOR_KEYS.keys() or getattr(builtins, getattr(fn, "__name__", ""), None) is fn:
        home = "operator" if fn in _OPERATOR_KEYS else "builtins"
        return f"{home}.{fn.__name__}"
    name: str = getattr(fn, "__name__", None) or repr(fn)
    if getattr(fn, "__objclass__", None) is not None and is_torch_callable(fn):
        return f"torch.Tensor.{name}"
    module: str | None = getattr(fn, "__module__", None)
    if module in (None, "torch._C._nn"):
        module = "torch.nn.functional" if module else None
    if module == "torch._C._VariableFunctions":
        module = "torch"
    return f"{module}.{name}" if module else name
