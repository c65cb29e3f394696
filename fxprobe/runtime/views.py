"""``fxprobe.to_dot``, ``fxprobe.render`` and ``fxprobe.summary``: what they are given, as a View.

Each public call turns its object into one :class:`~fxprobe.core.view.View` (:func:`view_of`,
:func:`listing_of`) and hands it to the readers in ``fxprobe.present``, which read nothing else.
A tapped module, a tapped artifact and a ``SiteNames`` listing hand over their own view
(``.view()``); a plain model is planned here (on a copy, never modified), and a deployed
artifact read from its graph (``runtime.pictures``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ..core.errors import FxProbeError, UnsupportedModelError
from ..core.options import TracerKind, check_choice
from ..core.select import select_ops
from ..core.site import Site
from ..core.view import View
from ..frontends.fx import plan
from ..frontends.mirror import drop_overrides, mirror
from ..present import summary as tables
from ..present import viz
from .artifact import TappedArtifact, artifact_kind, artifact_sites, tap_artifact
from .pictures import artifact_view, refuse_for_artifact, refuse_for_module, tapped_artifact_view
from .program import SiteNames, check_model, list_sites
from .shapes import propagate, refused_input, with_canonical
from .tapped import TappedModule

if TYPE_CHECKING:
    import graphviz

    from ..present.summary import Table


def to_dot(obj: nn.Module, example_input: Any = None, *,
           example_kwargs: Mapping[str, Any] | None = None, ops: Any = None,
           depth: int | None = None, tracer: TracerKind = "auto", train: bool | None = None,
           rankdir: str = "TB", show_plumbing: bool = False,
           focus: str | None = None, fold: bool = True) -> graphviz.Digraph:
    """Draw a tapped module, or a model, as a ``graphviz.Digraph``.

    Nodes are sites (name, op and, when known, dtype and shape); edges are data flow inside
    traced code. Tapped sites are filled orange with a bold border; sites reached by a module
    hook are dashed; modules that run as written because ``torch.fx`` could not trace them have
    a red dashed border and say why in their tooltip. Clusters follow the module hierarchy.

    Args:
        obj: a :class:`~fxprobe.TappedModule` (its selected sites are marked, and the shapes of
            its last forward shown) or any ``nn.Module`` (never modified).
        example_input: a tensor or a tuple of positional arguments to propagate shapes with:
            it runs through a private copy of the model, with no hook, tap or buffer update.
        example_kwargs: keyword arguments for that run.
        ops: for a plain model, the sites to mark as tapped (any ``ops=`` of ``fxprobe.tap``);
            None marks none.
        depth: draw every module nested deeper than ``depth`` levels as one node (0: only the
            model's direct children). None draws everything.
        tracer: for a plain model, as in ``fxprobe.tap``.
        train: for a plain model, draw its train-mode graph (default: its current mode).
        rankdir: Graphviz layout direction, ``"TB"`` (top to bottom) or ``"LR"``.
        show_plumbing: draw shape plumbing as nodes of its own. By default the ops that only
            compute sizes (``x.size()``, ``x.shape``, ``getitem`` and arithmetic on them, the
            tuples built for ``view``) are folded into the op they feed (listed in its
            tooltip; their inputs are linked to it), the attributes an op reads (``weight``,
            ``bias`` of a ``Conv1D``) are named in its label, and the inputs of a submodule
            traced on its own that have a default (``attn_mask=None``, ``is_causal=False``)
            are listed in one small node without edges. The model's own inputs left at a
            constant default (``attn_mask=None``) and the modules that pass their input
            through (``nn.Identity``, dropout in eval mode) are not drawn either: their input
            goes straight to their users, and the caption lists them. A tapped site is always
            drawn.
        focus: the path of one module to draw whole (``"blocks.3"``): nothing inside it is
            collapsed by ``depth``; without ``depth``, its siblings (and those of the modules
            around it) are drawn as one node each.
        fold: draw a run of three or more sibling blocks of one class (ResNet's
            ``layer3.0`` ... ``layer3.5``, a ViT's encoder layers) as its first block, then
            one node for the others, whose tooltip (SVG) lists their sites and shapes; a run
            ``depth`` draws as one node per block, or that holds ``focus``, is not folded.
            ``False`` draws every block.

    Returns:
        A ``graphviz.Digraph``; ``.source`` is the DOT text, ``.pipe("svg")`` renders it.

    Raises:
        ConfigError: a bad ``depth`` or ``rankdir``, ``ops``/``tracer``/``train`` given with a
            tapped module, or an ``example_input`` the model cannot run.
        SelectorError: a selector in ``ops`` matches no site.

    Example:
        >>> dot = fxprobe.to_dot(model, torch.randn(1, 3, 224, 224), ops=nn.Conv2d, depth=2)
        >>> dot.pipe("svg")
    """
    viz.check_drawing(depth, rankdir, fold)
    view = view_of(obj, ops=ops, tracer=tracer, train=train)
    return viz.to_dot(view, example_input, example_kwargs=example_kwargs, depth=depth,
                      rankdir=rankdir, show_plumbing=show_plumbing, focus=focus, fold=fold)


def render(obj: nn.Module, path: str | Path, **kwargs: Any) -> Path:
    """Write the picture of ``to_dot(obj, **kwargs)`` to ``path``, in the format of its suffix.

    ``.svg``, ``.png`` and ``.pdf`` are rendered by the Graphviz ``dot`` program; ``.dot`` (or
    ``.gv``) is the DOT text, which needs no Graphviz program.

    Returns:
        The path written.

    Raises:
        ConfigError: an unknown suffix. RenderError: ``dot`` is missing or fails.
    """
    path = viz.check_path(path)
    return viz.write(to_dot(obj, **kwargs), path)


def summary(obj: Any, fmt: str = "text") -> Table:
    """A table of sites: of a tapped module, of ``fxprobe.sites(...)``, or of a model.

    Args:
        obj: a :class:`~fxprobe.TappedModule` (its selected sites, with the shape, dtype and
            size of what the last forward captured, and statistics when the captured values
            are ``fxprobe.Stats`` records); a :class:`~fxprobe.SiteNames` from
            ``fxprobe.sites`` or a sequence of :class:`~fxprobe.Site` (name, op, module path,
            fx or hook); or an ``nn.Module``, listed as ``fxprobe.sites(model)`` would.
        fmt: ``"text"`` for the terminal, ``"github"`` (or ``"markdown"``), or ``"html"``.

    Returns:
        A :class:`Table`; ``print`` it, or ``table.render("html")``.

    Raises:
        ConfigError: ``fmt`` is not one of the formats above.
        UnsupportedModelError: ``obj`` is none of the above.

    Example:
        >>> print(fxprobe.summary(fxprobe.sites(model), fmt="github"))
    """
    tables.check_format(fmt)
    return tables.summary(listing_of(obj), fmt)


def view_of(obj: Any, *, ops: Any = None, tracer: TracerKind = "auto",
            train: bool | None = None) -> View:
    """What ``to_dot`` draws of ``obj``: a tapped module or artifact as it is (``ops``,
    ``tracer`` and ``train`` refused), a deployed artifact read from its graph, or a plain
    model planned on a copy in the mode asked (``ops`` marked)."""
    if isinstance(obj, TappedArtifact):
        refuse_for_artifact(ops, tracer, train, tapped=True)
        return tapped_artifact_view(obj, tap_artifact)
    if artifact_kind(obj) is not None:
        refuse_for_artifact(ops, tracer, train, tapped=False)
        return artifact_view(obj, tap_artifact, ops=ops)
    if isinstance(obj, TappedModule):
        refuse_for_module(ops, tracer, train)
        return obj.view()
    obj = check_model(obj, "fxprobe.to_dot")
    check_choice("tracer", tracer, TracerKind)
    root = mirror(obj)
    drop_overrides(root)
    training = obj.training if train is None else bool(train)
    root.train(training)
    p = with_canonical(plan(root, tracer=tracer))
    title = f"{type(obj).__name__} ({'train' if training else 'eval'} mode)"
    chosen: Sequence[Site] = ()
    if ops is not None:
        chosen = select_ops(p.sites, ops, context=title, model=obj, fallbacks=p.fallbacks)
    return View(title, tuple(p.sites), tuple(chosen), tuple(p.fallbacks), plan=p, root=root,
                shapes=partial(propagate, p, root))


def view_for_input(obj: nn.Module, example_input: Any, *, ops: Any = None,
                   tracer: TracerKind = "auto", train: bool | None = None) -> View:
    """What ``fxprobe graph --input`` draws: a plain model whose modules torch dynamo captures
    (a Hugging Face model) as ``fxprobe.tap`` captures it at the first forward
    (:func:`probed_view`); any other model, or an artifact, as :func:`view_of` plans it."""
    if artifact_kind(obj) is not None or isinstance(obj, (TappedModule, TappedArtifact)):
        return view_of(obj, ops=ops, tracer=tracer, train=train)
    view = view_of(obj, tracer=tracer, train=train)
    p = view.plan
    if p is not None and (p.deferred or p.dynamo):  # sites dynamo finds: run it as tap would
        return probed_view(obj, example_input, None, ops=ops, tracer=tracer,
                           training=view.root is not None and view.root.training)
    if ops is None or p is None:
        return view
    return replace(view, selected=tuple(select_ops(p.sites, ops, context=view.title, model=obj,
                                                   fallbacks=p.fallbacks)))


def probed_view(model: nn.Module, example_input: Any, example_kwargs: Mapping[str, Any] | None,
                *, ops: Any, tracer: TracerKind, training: bool) -> View:
    """What ``to_dot`` draws of a plain model whose modules torch dynamo captures, given an
    example input: the model tapped at every site as ``fxprobe.tap`` would (on a copy), run
    once, its sites and values as that forward found them, ``ops`` marked."""
    import torch

    from ..core.options import make_options

    probe = TappedModule(model, None, make_options(tracer=tracer))
    probe.train(training)
    # The probe shares the model's buffers: a train-mode forward would update its BatchNorm
    # statistics, which are put back as they were.
    buffers = [(b, b.clone()) for b in model.buffers()] if training else []
    try:
        args = example_input if isinstance(example_input, tuple) else (
            () if example_input is None else (example_input,))
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                probe(*args, **dict(example_kwargs or {}))
        except FxProbeError:
            raise
        except Exception as e:  # the model's own error: as runtime.shapes reports it
            raise refused_input(model, args, e) from e
        view = probe.view()
        chosen: Sequence[Site] = ()
        if ops is not None:
            known = probe.known_sites()
            chosen = select_ops([*known.records, *known.modules, *known.inner], ops,
                                context=view.title, model=model, fallbacks=known.fallbacks)
        return replace(view, selected=tuple(chosen), tapped=False)
    finally:
        probe.remove()
        with torch.no_grad():
            for buffer, before in buffers:
                buffer.copy_(before)


def listing_of(obj: Any) -> View:
    """What ``summary`` tabulates of ``obj`` (see :func:`summary`)."""
    if isinstance(obj, (TappedModule, SiteNames, TappedArtifact)):
        return obj.view()
    if artifact_kind(obj) is not None:
        return View("", tuple(s for s in artifact_sites(obj) if s.listed))
    if isinstance(obj, nn.Module):
        return list_sites(check_model(obj, "fxprobe.summary"), train=False, tracer="auto",
                          leaf_modules=(), autowrap_functions=()).view()
    if isinstance(obj, Sequence) and all(isinstance(s, Site) for s in obj):
        return View("", tuple(obj))
    raise UnsupportedModelError(
        f"fxprobe.summary() takes a TappedModule, the result of fxprobe.sites(), a list of "
        f"Site or an nn.Module; got {type(obj).__name__}"
    )
