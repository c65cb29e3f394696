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

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from ..capture.rewrite import copy_graph
from ..core.errors import ConfigError
from ..core.site import sites_of
from ..core.view import Plan, Region, ValueInfo
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
