"""``fxprobe.to_dot``, ``fxprobe.render`` and ``fxprobe.summary``: what they are given, as a View.

Each public call turns its object into one :class:`~fxprobe.core.view.View` (:func:`view_of`,
:func:`listing_of`) and hands it to the readers in ``fxprobe.present``, which read nothing else.
A tapped module, a tapped artifact and a ``SiteNames`` listing hand over their own view
(``.view()``); a plain model is planned here (on a copy, never modified), and a deployed
artifact read from its graph (``runtime.pictures``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ..core.errors import UnsupportedModelError
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
from .shapes import propagate
from .tapped import TappedModule

if TYPE_CHECKING:
    import graphviz

    from ..present.summary import Table


def to_dot(obj: nn.Module, example_input: Any = None, *,
           example_kwargs: Mapping[str, Any] | None = None, ops: Any = None,
           depth: int | None = None, tracer: TracerKind = "auto", train: bool | None = None,
           rankdir: str = "TB", show_plumbing: bool = False,
           focus: str | None = None) -> graphviz.Digraph:
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
    viz.check_drawing(depth, rankdir)
    view = view_of(obj, ops=ops, tracer=tracer, train=train)
    return viz.to_dot(view, example_input, example_kwargs=example_kwargs, depth=depth,
                      rankdir=rankdir, show_plumbing=show_plumbing, focus=focus)


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
    p = plan(root, tracer=tracer)
    title = f"{type(obj).__name__} ({'train' if training else 'eval'} mode)"
    chosen: Sequence[Site] = ()
    if ops is not None:
        chosen = select_ops(p.sites, ops, context=title, model=obj, fallbacks=p.fallbacks)
    return View(title, tuple(p.sites), tuple(chosen), tuple(p.fallbacks), plan=p, root=root,
                shapes=partial(propagate, p, root))


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
