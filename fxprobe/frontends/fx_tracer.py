"""The fx frontend's tracer: ``torch.fx`` with torchvision's site names, one :class:`Site` per node.

:class:`SiteTracer` traces one module (``frontends.fx`` plans which, and falls back per module
where it fails). It records ``x += y`` as the in-place op it is, names nodes as torchvision's
``get_graph_node_names`` does (:class:`Namer`) and marks a module call fx traces through with a
site of its own on the call's last node.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import fx, nn

from ..capture.inplace import OUT_OF_PLACE
from ..capture.settle import as_returned, settle
from ..core.names import join as _join
from ..core.ops import AUGMENTED_OPERATORS, method_key, module_key, op_key
from ..core.site import CALL_ARGS, Site, attach
from .mirror import user_hooks


class SiteTracer(fx.Tracer):
    """The fx frontend's tracer: every node it records carries its :class:`Site` in
    ``node.meta`` (see :func:`fxprobe.core.site.attach`), named as torchvision names it.

    Buffers are traced as graph values (``proxy_buffer_attributes``): otherwise a forward that
    updates a buffer in place (a counter, a running statistic) would write into the model's
    real buffer once while tracing and be missing from the graph. A buffer, and a value computed
    from buffers alone, is no site: torchvision's tracer sees constants there. A call of a
    module that fx traces through gets a site too (its path, ``inlined=True``) on the call's
    last node.

    torchvision's ``get_graph_node_names`` keeps ``torchvision.ops`` modules whole
    (:func:`library_blocks`: ``Conv2dNormActivation``, ``MLP``...) and names one node per call.
    This tracer traces through them, so that their convolutions and activations stay sites, but
    lists the call (its path, ``listed=True``) in their place and the sites inside them with
    ``listed=False``: ``fxprobe.sites(model)`` then equals torchvision's names. It records
    ``torchvision.ops`` functions as single calls (:func:`autowrap_modules`), as torchvision
    does.
    """

    proxy_buffer_attributes = True

    def __init__(self, prefix: str, leaf_types: tuple[type, ...], leaf_paths: frozenset[str],
                 opaque: set[str], autowrap_functions: tuple[Callable[..., Any], ...],
                 blocks: tuple[type, ...] = ()) -> None:
        # fx annotates autowrap_modules as a 1-tuple; it takes any number of modules.
        super().__init__(autowrap_modules=autowrap_modules(),  # type: ignore[arg-type]
                         autowrap_functions=autowrap_functions)
        self.prefix = prefix
        self.leaf_types = leaf_types
        self.leaf_paths = leaf_paths
        self.opaque = opaque
        self.current = ""
        self.failed_path: str | None = None
        self.node_names = Namer()
        self.call_names = Namer(strip=False)
        self.taken: set[str] = set()
        self.buffer_values: set[fx.Node] = set()
        self.blocks = blocks
        self.inside_blocks = 0

    def absolute(self, path: str) -> str:
        return _join(self.prefix, path)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        graph = super().trace(root, concrete_args)
        _unbind_augmented(graph)
        return graph

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.opaque:
            return True
        if module_qualified_name and user_hooks(m):
            return True  # a boundary: called as a module, so its hooks run at every call
        return is_leaf(m, self.absolute(module_qualified_name), self.leaf_types, self.leaf_paths)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        old = self.current
        try:
            path = self.path_of_module(m)
            self.current = path
            if self.is_leaf_module(m, path):
                return self.create_proxy("call_module", path, args, kwargs)
            before = self.graph._root.prev  # the last node so far (the root sentinel if none)
            block = bool(path) and bool(self.blocks) and isinstance(m, self.blocks)
            self.inside_blocks += block
            try:
                out = forward(*args, **kwargs)
            except Exception:
                if self.failed_path is None:  # the innermost module sees the error first
                    self.failed_path = path
                raise
            finally:
                self.inside_blocks -= block
            listed = block and not self.inside_blocks
            last = out.node if isinstance(out, fx.Proxy) else None
            if last is None and listed and _holds_proxy(out):
                # A block that returns a nest (an FPN's dict) is one node in torchvision's
                # graph: one node that hands the nest on stands for it here.
                last = self.graph.create_node("call_function", _nest, (_nodes_of(out),), {})
            made = before.next if before.next is not self.graph._root else None
            if path and last is not None and made is not None and not _made_since(before, last):
                # The call hands back a value made before it (its input) and ran ops: the
                # value it returns is that one after those ops (which may have written it in
                # place), so the site sits on a node after them.
                last = self.graph.create_node("call_function", _nest, (last,), {})
            if path and last is not None and _made_since(before, last):
                # Written in place later in the call (``y.copy_(z)``, through a view): the site
                # is on the write, or on a node after it that the code after the call reads.
                settled = settle(last, _nodes_after(last), self.root.get_submodule)
                if settled.target is as_returned and isinstance(out, fx.Proxy) \
                        and out.node is last:
                    out = self.proxy(settled)
                last = settled
            if path and last is not None:
                first = made if made is not None else last
                self._name_call(m, path, last, args, first, listed=listed)
            return out
        finally:
            self.current = old

    def _name_call(self, m: nn.Module, path: str, last: fx.Node, args: tuple[Any, ...],
                   first: fx.Node, listed: bool) -> None:
        target = self.absolute(path)
        # A listed block call is a node of torchvision's graph: it counts among the nodes.
        namer = self.node_names if listed else self.call_names
        name = self._unique(namer.next(target))
        attach(last, Site(name, "fx", "call_module", target, target, type(m), None,
                          inlined=True, listed=listed))
        arg_nodes = tuple(a.node if isinstance(a, fx.Proxy) else a for a in args)
        last.meta.setdefault(CALL_ARGS, {})[name] = (arg_nodes, first)

    def create_proxy(self, kind: str, target: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any], name: str | None = None, type_expr: Any = None,
                     *rest: Any) -> fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, *rest)
        node = proxy.node
        if kind == "get_attr" and self._is_buffer(str(target)):
            self.buffer_values.add(node)
            return proxy  # torchvision's tracer makes no named node for a buffer
        inputs = node.all_input_nodes
        if kind in ("call_function", "call_method") and inputs and all(
                n in self.buffer_values for n in inputs):
            # torchvision's tracer sees a buffer as a constant tensor: what is computed from
            # buffers alone (maxvit's relative_position_index.view(-1)) runs eagerly there and
            # is no node, so it is no site here either (and takes no name from later nodes).
            self.buffer_values.add(node)
            return proxy
        module_path = self.absolute(self.current)
        qual = module_path
        if node.op != "call_module":
            qual = _join(qual, node.name)
        site = self._site(self._unique(self.node_names.next(qual)), node, module_path)
        if self.inside_blocks:
            site = dataclasses.replace(site, listed=False)
        attach(node, site)
        return proxy

    def _site(self, name: str, node: fx.Node, module_path: str) -> Site:
        if node.op == "call_module":
            target = self.absolute(str(node.target))
            mtype = type(self.root.get_submodule(str(node.target)))
            return Site(name, "fx", node.op, target, target, mtype, module_key(mtype))
        if node.op == "call_function":
            # x += y shows as torchvision shows it (operator.add); its node runs operator.iadd.
            fn = AUGMENTED_OPERATORS.get(node.target, node.target)
            return Site(name, "fx", node.op, fn, module_path, None, op_key(node.target))
        if node.op == "call_method":
            key = method_key(str(node.target))
            return Site(name, "fx", node.op, node.target, module_path, None, key)
        return Site(name, "fx", node.op, node.target, module_path, None, None)

    def _unique(self, name: str) -> str:
        # torchvision's scheme can repeat a name (a module "x" called twice beside a module
        # "x_1"); a site name must be unique, so a repeat is suffixed further.
        base, n = name, 1
        while name in self.taken:
            name = f"{base}_{n}"
            n += 1
        self.taken.add(name)
        return name

    def _is_buffer(self, target: str) -> bool:
        owner, _, attr = target.rpartition(".")
        try:
            module = self.root.get_submodule(owner)
        except AttributeError:
            return False
        return attr in module._buffers


class _Proxy(fx.Proxy):
    """fx's Proxy, recording ``x += y`` as the in-place op it is (``operator.iadd``).

    fx's Proxy has no ``__iadd__``: Python falls back to ``__add__`` and rebinds the name, so
    a view or a second name of a tensor ``x`` would miss the update (and a model input would
    not be updated). The node takes the name fx gives ``x + y`` (``add``): site names stay
    torchvision's, and the op key (``_ops.op_key``) stays ``add``.
    """

    def __getattr__(self, k: str) -> fx.proxy.Attribute:
        return _Attribute(self, k)  # ``h.T += 1`` too


def _augmented(op: Callable[[Any, Any], Any], twin: Callable[[Any, Any], Any]
               ) -> Callable[[fx.Proxy, Any], fx.Proxy]:
    def impl(self: fx.Proxy, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", op, (self, other), {}, twin.__name__)

    impl.__name__ = impl.__qualname__ = f"__{op.__name__}__"
    return impl


class _Attribute(fx.proxy.Attribute):
    """fx's attribute proxy (``h.T``, ``h.data``) with :class:`_Proxy`'s ``x += y``: ``v = h.T;
    v += 1`` writes ``h``."""

    def __getattr__(self, k: str) -> fx.proxy.Attribute:
        return _Attribute(self, k)


for _op, _twin in AUGMENTED_OPERATORS.items():
    for _cls in (_Proxy, _Attribute):
        setattr(_cls, f"__{_op.__name__}__", _augmented(_op, _twin))


def _unbind_augmented(graph: fx.Graph) -> None:
    """fx writes ``operator.iadd(x, y)`` as ``x += y; add = x``, rebinding ``x``: right for a
    tensor (the same object), wrong for a number that a node after it still reads as ``x``.
    Such a node gets a name of its own to update (``_nest``: the value as it is)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target in AUGMENTED_OPERATORS
                and node.args and isinstance(node.args[0], fx.Node)):
            continue
        first = node.args[0]
        if any(order.get(u, -1) > order[node] for u in first.users):
            with graph.inserting_before(node):
                name = graph.call_function(_nest, (first,))
            node.args = (name, *node.args[1:])


def _made_since(before: fx.Node, node: fx.Node) -> bool:
    """Whether ``node`` comes after ``before`` in the graph (a call made it, ``before`` being
    the last node before the call)."""
    n = before.next
    while n.op != "root":
        if n is node:
            return True
        n = n.next
    return False


def _nodes_after(node: fx.Node) -> list[fx.Node]:
    """The nodes after ``node``, in graph order."""
    out, n = [], node.next
    while n.op != "root":
        out.append(n)
        n = n.next
    return out


def _nest(value: Any) -> Any:
    """What a block returned, as it is (the node a nest-returning block's site sits on)."""
    return value


setattr(_nest, OUT_OF_PLACE, True)  # writes nothing (for the in-place analysis)


def _holds_proxy(value: Any) -> bool:
    found = False

    def visit(v: Any) -> Any:
        nonlocal found
        found = found or isinstance(v, fx.Proxy)
        return v

    fx.node.map_aggregate(value, visit)
    return found


def _nodes_of(value: Any) -> Any:
    return fx.node.map_aggregate(value, lambda v: v.node if isinstance(v, fx.Proxy) else v)


class Namer:
    """torchvision's ``get_graph_node_names`` naming: fx's global ``_N`` suffix is replaced by a
    count local to the name (``layer1.0.relu``, ``layer1.0.relu_1``). With ``strip=False`` (the
    calls fx traces through, named by module path) a name's own ``_N`` is kept: the first call
    of ``encoder.layers.encoder_layer_0`` is named so, as in every other frontend."""

    def __init__(self, strip: bool = True) -> None:
        self.last: dict[str, int] = {}
        self.strip = strip

    def next(self, name: str) -> str:
        if self.strip and re.match(r".+_[0-9]+$", name) is not None:
            name = name.rsplit("_", 1)[0]
        # The most recent earlier name of the form {name} or {name}_{k} decides the suffix.
        index = self.last.get(name)
        if index is not None:
            name = f"{name}_{index + 1}"
        self.last[name] = 0
        base, sep, digits = name.rpartition("_")
        if sep and digits.isdigit() and (self.strip or index is not None):
            # A kept own _N is no count: the first call of layer_0 leaves layer's count alone
            # (else the first call of a module `layer` beside it would be named layer_1).
            self.last[base] = int(digits)
        return name


def is_leaf(m: nn.Module, path: str, leaf_types: tuple[type, ...],
            leaf_paths: frozenset[str]) -> bool:
    """fx's default leaves (torch.nn modules but Sequential) plus the user's ``leaf_modules``
    (``leaf_types`` and ``leaf_paths``)."""
    if path in leaf_paths or (leaf_types and isinstance(m, leaf_types)):
        return True
    mod = type(m).__module__
    return (mod.startswith("torch.nn") or mod.startswith("torch.ao.nn")) and not isinstance(
        m, nn.Sequential
    )


def autowrap_modules() -> tuple[ModuleType, ...]:
    """Modules whose functions fx records as single calls: fx's ``math`` and, as torchvision's
    ``get_graph_node_names`` does, ``torchvision.ops`` (``stochastic_depth``, ``nms``...)."""
    ops = _torchvision_ops()
    return (math,) if ops is None else (math, ops)


def _torchvision_ops() -> ModuleType | None:
    # A model holding a torchvision ops module or calling one of its functions has imported
    # torchvision.ops already; fxprobe never imports torchvision itself.
    return sys.modules.get("torchvision.ops")
