"""Shape propagation: the dtype and shape at every site of a plan, for one example input.

The runtime computes these records (:class:`~fxprobe.core.view.ValueInfo`, by site name) for the
pictures, which read them from a :class:`~fxprobe.core.view.View` (its ``shapes``).

The example runs through a private copy of the model whose traced regions report each named
value as it is made and whose hook sites report their outputs. Nothing of the user's runs or
changes: the copy drops the hooks registered on the model's modules (global module hooks,
``torch.nn.modules.module.register_module_forward_hook``, still fire), its buffers are clones
(a train-mode BatchNorm updates the copies), and the random number generator is restored.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..capture.rewrite import copy_graph
from ..core.errors import ConfigError
from ..core.site import SITES, node_site, sites_of
from ..core.view import Plan, Region, ValueInfo
from ..frontends.canonical import annotate
from ..frontends.canonical_graph import ATTENTION_MODULE, FxIndex
from ..frontends.dynamo_names import NamedGraph
from ..frontends.mirror import drop_overrides, mirror
from ..present.summary import describe_value

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
               "_backward_hooks", "_backward_pre_hooks")


def propagate(p: Plan, source: nn.Module, args: Sequence[Any],
              kwargs: Mapping[str, Any]) -> dict[str, ValueInfo]:
    """Shape, dtype and size at every site of ``p`` for one run of ``args``.

    The run uses a private copy of ``source``: the user's hooks and fxprobe's taps do not fire,
    buffers (BatchNorm statistics) are copies, the random number generator is restored after.
    """
    work = private_copy(source)
    infos: dict[str, ValueInfo] = {}

    def note(key: str, value: Any) -> None:
        if key not in infos:  # a module called twice: its first call
            infos[key] = describe_value(value)

    runners: dict[str, fx.GraphModule] = {}
    for path, region in p.regions.items():
        module = work.get_submodule(path) if path else work
        runners[path] = _noting_module(region, module, note)
        if path:
            object.__setattr__(module, "forward", runners[path].forward)
    for s in p.sites:
        if s.how == "hook":
            module = work.get_submodule(s.name) if s.name else work
            module.register_forward_hook(
                lambda m, a, out, key=s.name: note(key, out))
    note("/input", args[0] if len(args) == 1 and not kwargs else tuple(args))
    root = runners.get("")
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = root(*args, **kwargs) if root is not None else work(*args, **kwargs)
    except Exception as e:
        raise refused_input(source, args, e) from e
    note("/output", out)
    return infos


def private_copy(source: nn.Module) -> nn.Module:
    """A copy of ``source``'s module tree for a private run: no hooks (the model keeps its
    own), no replaced forwards, buffers of its own (a train-mode BatchNorm updates copies);
    the parameters are the model's."""
    work = mirror(source, share_state=False)
    drop_overrides(work)
    for module in work.modules():
        for name in _HOOK_DICTS:
            hooks = module.__dict__.get(name)
            if isinstance(hooks, dict):
                hooks.clear()  # the copy's own dict; the model keeps its hooks
        buffers = module.__dict__["_buffers"]
        for key, buf in buffers.items():
            if buf is not None:
                buffers[key] = buf.clone()
    return work


def refused_input(model: nn.Module, args: Sequence[Any], e: BaseException) -> ConfigError:
    """The error for an example input ``model`` cannot run (``e``, its own error): what was
    given, what the model raised, what to pass instead."""
    shown = ", ".join(describe_value(a).label or type(a).__name__ for a in args)
    return ConfigError(
        f"the example input ({shown}) does not run through {type(model).__name__}: "
        f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}; "
        + (_token_id_hint(model, args) or
           "pass inputs its forward accepts (a tensor, or a tuple of positional arguments)"))


def _token_id_hint(source: nn.Module, args: Sequence[Any]) -> str | None:
    """How to give token ids, when a float input met a model that embeds them."""
    floats = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    embeddings = [(path, m) for path, m in source.named_modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    if not floats or not embeddings:
        return None
    path, emb = embeddings[0]
    shape = tuple(floats[0].shape)
    size = "x".join(map(str, shape)) or "1"
    return (f"{type(source).__name__} looks like it takes token ids: {path!r} is an "
            f"nn.{type(emb).__name__}, which needs integer indices, and the example input is "
            f"{str(floats[0].dtype).removeprefix('torch.')}. Give int64 ids: on the command "
            f"line --input {size}:int64 (ids 0), in Python "
            f"torch.randint(0, {emb.num_embeddings}, {shape})")


def _noting_module(region: Region, module: nn.Module, note: Any) -> fx.GraphModule:
    """A copy of the region's graph that reports each named value to ``note`` as it is made."""
    graph = copy_graph(region.graph)
    for node in list(graph.nodes):
        if node.op == "output":
            key = "/output" if not region.path else f"{region.path}/return"
            with graph.inserting_before(node):
                graph.call_function(note, (key, node.args[0]))
            continue
        for site in sites_of(node):
            with graph.inserting_after(node):
                graph.call_function(note, (site.name, node))
    return fx.GraphModule(module, graph)


def with_canonical(p: Plan) -> Plan:
    """``p`` with the transformer vocabulary's names (``blocks.3.resid_post``) on its sites,
    where torch.fx traced the whole model and the canonical pass recognises its family.

    The pass (``frontends.canonical``, the one dynamo's graphs go through) reads each value's
    shape; an fx graph has none, so its graph runs once on fake tensors (nothing computed)
    and a private copy of the module tree (nothing of the model changes, none of its hooks
    runs, the random state is restored), fed an input shaped as the graph reads it
    (:func:`fake_input`). Where no input can be made, the run fails, or the graph holds no
    attention, ``p`` comes back as it is (a canonical name then matches nothing and says why).
    """
    region = p.root_region
    if region is None or p.fallbacks or p.dynamo or p.deferred:
        return p
    g = FxIndex(region.graph, region.module, "")
    if not any(g.key(n) in _KERNELS for n in g.nodes):
        return p
    args = fake_input(region)
    if args is None:
        return p
    saved = {n: n.meta.get(SITES) for n in region.graph.nodes}
    try:
        # A private copy (a BatchNorm's step counter is written even under fake tensors).
        work = private_copy(region.module)
        with torch.random.fork_rng(devices=[]), FakeTensorMode(allow_non_fake_inputs=True):
            _Shapes(work, region.graph).run(*(make() for make in args))  # made inside: fake
        sites = {n: s for n in region.graph.nodes if (s := node_site(n)) is not None}
        named = NamedGraph(sites, {}, [s for _, s in region.sites()],
                           frozenset(s.module_path for s in sites.values()))
        annotate(region.graph, named, root=region.module, root_path="", traced=True)
    except Exception:  # noqa: BLE001 (a graph fake tensors cannot run: no canonical names)
        for n, found in saved.items():
            if found is not None:
                n.meta[SITES] = found
        return p
    finally:
        for n in region.graph.nodes:
            n.meta.pop("example_value", None)
    new = {s.name: s for _, s in region.sites()}
    return dataclasses.replace(p, sites=[new.get(s.name, s) for s in p.sites])


_KERNELS = frozenset({"scaled_dot_product_attention", "softmax", "_softmax", ATTENTION_MODULE})

POSITIONS = 7
"""The positions of the fake token ids (and the batch: 2), odd so that no size stands for
another by chance."""


def fake_input(region: Region) -> list[Callable[[], Any]] | None:
    """How to make each argument of the graph: a default as it is; a tensor read by an
    ``nn.Embedding`` token ids ``(2, 7)``; one read by an ``nn.Conv2d`` an image ``(2, C, H,
    W)`` at the model's size (torchvision's ``image_size``, timm's ``patch_embed.img_size``
    or ``pretrained_cfg["input_size"]``, else 224). None where an argument is neither."""
    root = region.module
    made: list[Callable[[], Any]] = []
    for n in region.graph.nodes:
        if n.op != "placeholder":
            continue
        if n.args:  # a default
            made.append(functools.partial(_given, n.args[0]))
            continue
        users = [root.get_submodule(str(u.target)) for u in n.users if u.op == "call_module"]
        if any(isinstance(m, nn.Embedding) for m in users):
            made.append(functools.partial(torch.zeros, 2, POSITIONS, dtype=torch.long))
        elif any(isinstance(m, nn.Conv2d) for m in users):
            conv = next(m for m in users if isinstance(m, nn.Conv2d))
            made.append(functools.partial(torch.zeros, 2, conv.in_channels, *_image_size(root)))
        else:
            return None
    return made


def _given(value: Any) -> Any:
    return value


def _image_size(root: nn.Module) -> tuple[int, int]:
    cfg = getattr(root, "pretrained_cfg", None) or getattr(root, "default_cfg", None)
    for size in (getattr(root, "image_size", None),
                 getattr(getattr(root, "patch_embed", None), "img_size", None),
                 cfg.get("input_size", (None,))[1:] if isinstance(cfg, dict) else None):
        if isinstance(size, int):
            return size, size
        if isinstance(size, (tuple, list)) and len(size) == 2 and all(
                isinstance(s, int) for s in size):
            return int(size[0]), int(size[1])
    return 224, 224


class _Shapes(fx.Interpreter):
    """Runs a graph, keeping each value in ``node.meta["example_value"]`` (as dynamo does)."""

    def __init__(self, module: nn.Module, graph: fx.Graph) -> None:
        super().__init__(module, garbage_collect_values=True, graph=graph)

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        n.meta["example_value"] = value
        return value
