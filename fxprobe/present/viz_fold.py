"""Repeated blocks folded: a run of sibling blocks of one class (ResNet's ``layer3.0`` ...
``layer3.5``, a ViT's 12 encoder layers) is drawn as its first block, whole, then one node
that stands for the others, whose tooltip lists their sites.

``fxprobe.to_dot(..., fold=True)`` (the default) folds; ``fold=False`` draws every block.
A block drawn as one node already (by ``depth``) is not folded again, nor is a run that holds
the ``focus`` module or lies inside it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from torch import nn

from ..core.site import Site
from ..core.view import ValueInfo
from .viz_items import Item, path_depth, path_inside

MIN_RUN = 3
"""The fewest sibling blocks of one class that fold (the first drawn, the others one node)."""

TIP_LINES = 200
"""The most sites a collapsed node's tooltip lists (the rest are counted)."""

_NUMBERED = re.compile(r"^(.*?)(\d+)$")


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def block_runs(root: nn.Module) -> list[list[str]]:
    """Runs of at least :data:`MIN_RUN` consecutive sibling modules that hold submodules, are
    of one class, and are named alike but for a trailing number (``0``, ``1``, ... of a
    ``Sequential``/``ModuleList``; ``encoder_layer_0``, ...): their paths, in order.

    Containers (``Sequential``, ``ModuleList``, ``ModuleDict``: ResNet's ``layer1`` ...
    ``layer4``) are stages, not blocks, and do not fold: their blocks do.
    """
    runs: list[list[str]] = []
    for path, module in root.named_modules():
        run: list[str] = []
        key: tuple[object, ...] | None = None
        for name, child in module.named_children():
            m = _NUMBERED.match(name)
            this = (type(child), m.group(1)) if m and not _container(child) \
                and any(True for _ in child.children()) else None
            if this is not None and this == key:
                run.append(f"{path}.{name}" if path else name)
                continue
            if len(run) >= MIN_RUN:
                runs.append(run)
            key, run = this, ([f"{path}.{name}" if path else name] if this else [])
        if len(run) >= MIN_RUN:
            runs.append(run)
    return runs


def _container(module: nn.Module) -> bool:
    # by name too: a deployed artifact's stand-in modules only carry the class names
    return isinstance(module, _CONTAINERS) or type(module).__name__ in (
        "Sequential", "ModuleList", "ModuleDict")


def fold_blocks(items: Sequence[Item], rep: dict[str, Item], runs: Sequence[Sequence[str]],
                depth: int | None, focus: str | None) -> tuple[dict[str, Item], list[Item]]:
    """``rep`` (item id -> what is drawn for it) with the items of every run's blocks but the
    first mapped to one node for the run; returns it and the fold nodes made.

    A run whose blocks ``depth`` draws as one node each (or hides in a bigger one) is left as
    it is, and so is one that holds the focus or lies inside it.
    """
    rep = dict(rep)
    made: list[Item] = []
    for run in runs:
        if depth is not None and path_depth(run[0]) > depth:
            continue  # each block is one node already, or inside one
        if focus is not None and any(path_inside(focus, b) or path_inside(b, focus)
                                     for b in run):
            continue
        rest = run[1:]
        members = [it for it in items
                   if any(path_inside(rep[it.id].owner, b) for b in rest)]
        if not members:
            continue
        node = Item(f"{rest[0]}/fold", "group", rest[0], rest[0], None, members,
                    span=list(rest))
        for it in members:
            rep[it.id] = node
        rep[node.id] = node
        made.append(node)
    return rep, made


def site_lines(sites: Sequence[Site], infos: Mapping[str, ValueInfo]) -> list[str]:
    """One tooltip line per site: ``layer1.1.conv1: Conv2d float32 [1, 64, 56, 56]``, at most
    :data:`TIP_LINES` of them."""
    lines = []
    for s in sites[:TIP_LINES]:
        info = infos.get(s.name)
        shown = f" {info.label}" if info is not None and info.label else ""
        lines.append(f"{s.name}: {s.op}{shown}")
    if len(sites) > TIP_LINES:
        lines.append(f"... and {len(sites) - TIP_LINES} more")
    return lines
