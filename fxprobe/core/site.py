"""``Site``: one place in a model where fxprobe can capture a value."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import fx, nn

from .irtypes import op_name, python_type
from .ops import describe_function, method_key, module_key
from .shard import Sharding

How = Literal["fx", "hook", "dynamo", "script", "export"]

SITES = "fxprobe_sites"
"""``node.meta`` key of a frontend's graph: the :class:`Site` s whose value is that node's value."""
STATE = "fxprobe_state"
"""``node.meta`` key on a placeholder of a dynamo graph that is a module's parameter or buffer
(not a value the code around the graph could write: see ``capture.inplace.Hazards``)."""
SOURCE = "fxprobe_source"
"""``node.meta`` key on a placeholder of a dynamo graph: where dynamo took the input from
(``"L['self']._modules['h']._parameters['weight']"``). Dynamo drops its own record of it
(``node.meta["grapharg"]``) once the backend returns, and fxprobe names the same graph again
later (another module instance, a repeat, the graph with intervention points)."""
KERNEL_KV = "fxprobe_kernel_kv"
"""``node.meta`` key on a node whose value an attention kernel reads as its keys or values
(``blocks.L.attn.k``/``.v``, set by ``frontends.canonical``). Such a value is the KV cache as
well: dynamo writes it back into the cache object from the graph's output, a model returns it
in ``past_key_values``, a static cache is written in place. An edit there applies to what the
kernel reads at this step, as an edit inside the eager kernel does; the cache keeps what the
model computed, else the next step would edit the edited positions again (:func:`unedited`)."""
KERNEL = "fxprobe_kernel"
"""``node.meta`` key on the node of an attention kernel that reads keys or values
(``F.scaled_dot_product_attention``; eager attention's ``q @ k.T`` and its ``probs @ v``)."""
CALL_ARGS = "fxprobe_call_args"
"""``node.meta`` key on the last node of a module call fx traced through: for each of its sites,
``(positional argument nodes, first node of the call)``, so that its inputs can be captured."""


def _as_str(what: str) -> None:
    warnings.warn(f"a Site is a record, not a str: use site.name (site.name.{what}); "
                  "fxprobe.sites() lists Sites since this release, and a Site answers str "
                  "methods for one release only", DeprecationWarning, stacklevel=3)


@dataclass(frozen=True, eq=False)
class Site:
    """One tappable place: an fx node, or a module call reached by a hook."""

    name: str
    """Qualified site name, as torchvision's ``get_graph_node_names`` spells it."""
    how: How
    """The frontend that reaches it: ``"fx"`` (a tap in a traced graph), ``"hook"`` (a module
    hook in code that runs as written), later ``"dynamo"``, ``"script"``, ``"export"``."""
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
    inlined: bool = False
    """A call of a module that fx traced through: its value is the output of the call's last
    node (no node of its own), its inputs the call's arguments."""
    listed: bool = True
    """Listed by ``fxprobe.sites(model)``, whose names are torchvision's ``get_graph_node_names``:
    every node but calls fx traced through and the sites inside blocks torchvision keeps whole
    (a ``Conv2dNormActivation``: its call is listed, its convolution is a site all the same)."""
    type_name: str | None = None
    """Qualified class name of the called module where no Python class is at hand
    (TorchScript, torch.export): ``torchvision.models.resnet.BasicBlock``."""
    canonical: tuple[str, ...] = field(default=(), compare=False)
    """The names it also answers to in fxprobe's one vocabulary of transformers
    (``blocks.3.resid_post``, ``blocks.4.resid_pre``: one value, two roles), derived from the
    graph by ``frontends.canonical``; empty elsewhere. Name and glob selectors match them."""
    sharding: Sharding | None = field(default=None, compare=False)
    """Under tensor parallelism, which part of the full value this rank's value is (the
    dimension split over which ranks, or a partial sum: :class:`~fxprobe.core.shard.Sharding`,
    found by ``frontends.sharding``); None where every rank holds the full value."""

    # -- where code expects a site name (``fxprobe.sites()`` listed names before it listed
    # Sites): a Site is equal to its name, hashes as its name (a dict or set keyed by names
    # finds it), prints as its name; str methods still answer, with a DeprecationWarning.
    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return self.name == other
        if not isinstance(other, Site):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    def _key(self) -> tuple[Any, ...]:
        return (self.name, self.how, self.kind, self.module_path, self.op_key, self.inlined,
                self.listed, self.type_name)

    def __contains__(self, text: str) -> bool:
        _as_str("__contains__")
        return text in self.name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_") or attr == "name" or not hasattr(str, attr):
            raise AttributeError(f"'Site' object has no attribute {attr!r}")
        _as_str(attr)
        return getattr(self.name, attr)

    @property
    def op(self) -> str:
        """A readable name of what the site computes (``Conv2d``, ``torch.flatten``, ``.add``)."""
        if self.kind == "call_module":
            if self.module_type is not None:
                return self.module_type.__name__
            return self.type_name.rpartition(".")[2] if self.type_name else "module"
        if self.kind == "call_function":
            if isinstance(self.target, str):  # an IR op: aten::flatten, aten.softmax.int
                return self.target
            return describe_function(self.target)
        if self.kind == "call_method":
            return f".{self.target}()"
        if self.kind == "placeholder":
            return "input"
        return "attribute"

    def to_row(self) -> list[str]:
        """The site as the strings a tapped artifact saves (a TorchScript attribute, an export
        node's ``meta["custom"]``): name, kind, target, module path, type name, inlined and
        listed as ``"0"``/``"1"``. :meth:`from_row` reads it back."""
        return [self.name, self.kind, str(self.target), self.module_path, self.type_name or "",
                str(int(self.inlined)), str(int(self.listed))]

    @classmethod
    def from_row(cls, row: Sequence[str], how: How) -> Site:
        """The site a saved row (:meth:`to_row`) describes, as the frontend ``how`` made it."""
        name, kind, target, path, tname, inlined, listed = row
        ptype = python_type(tname) if tname else None
        key: str | None
        if "::" in target:  # a TorchScript op: aten::add_
            key = op_name(target)
        elif target.startswith("aten."):  # an ATen overload: aten.add_.Tensor
            key = method_key(target.split(".")[1])
        elif kind == "call_function":  # a function by its qualified name
            key = method_key(target.rpartition(".")[2])
        else:
            key = module_key(ptype)
        return cls(name, how, kind, target, path, ptype, key, inlined=inlined == "1",
                   listed=listed == "1", type_name=tname or None)


def sites_of(node: fx.Node) -> list[Site]:
    """The sites a frontend attached to ``node`` (empty for plumbing it does not name)."""
    return node.meta.get(SITES, [])


def source_name(node: fx.Node) -> str | None:
    """Where dynamo took a placeholder's value from (see :data:`SOURCE`), if known."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    name = name() if callable(name) else name
    if isinstance(name, str):
        return name
    kept = node.meta.get(SOURCE)
    return kept if isinstance(kept, str) else None


def unedited(node: fx.Node) -> Callable[[fx.Node], bool]:
    """Which readers of ``node`` keep its value as computed when an edit replaces it: where the
    node is a kernel's keys or values (:data:`KERNEL_KV`), those from which no attention
    kernel is reached (the graph's output that writes the KV cache back, ``torch.stack((k,
    v))`` returned as ``past_key_values``, ``cache.index_copy_(2, pos, k)``); none elsewhere."""
    if not node.meta.get(KERNEL_KV):
        return lambda user: False
    feeds: dict[fx.Node, bool] = {}
    for n in reversed(node.graph.nodes):  # a node's readers come after it
        feeds[n] = bool(n.meta.get(KERNEL)) or any(feeds.get(u, False) for u in n.users)
        if n is node:
            break
    if not feeds[node]:
        return lambda user: False  # no kernel reads it here: the edit goes where it goes
    return lambda user: not feeds.get(user, False)


def attach(node: fx.Node, site: Site) -> None:
    """Record that ``site``'s value is ``node``'s value."""
    node.meta.setdefault(SITES, []).append(site)


def node_site(node: fx.Node) -> Site | None:
    """The site that names ``node`` itself (not a module call it ends), if any."""
    for site in sites_of(node):
        if not site.inlined:
            return site
    return None


def reach(starts: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]], *,
          into: set[fx.Node] | None = None, where: Callable[[fx.Node], bool] | None = None
          ) -> set[fx.Node]:
    """The nodes reached from ``starts`` by ``step`` (``node.all_input_nodes``: what it is
    computed from; ``node.users``: what reads it), ``starts`` included: the one graph walk.

    Args:
        into: the set to add them to (and return); a node already in it is not walked again.
        where: only nodes it accepts are reached, or walked through.
    """
    out: set[fx.Node] = set() if into is None else into
    todo = list(starts)
    while todo:
        x = todo.pop()
        if x in out or (where is not None and not where(x)):
            continue
        out.add(x)
        todo.extend(step(x))
    return out
