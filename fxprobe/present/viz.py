"""Graph export: a model's sites as a Graphviz picture, tapped sites and hook fallbacks marked.

``to_dot`` draws the plan fxprobe makes of a model: every traced region's fx graph (one node per
site, edges for data flow), the modules that run as written because ``torch.fx`` could not trace
them (with the reason in a tooltip) and the hook sites inside them, all nested in clusters that
follow the module hierarchy. Shapes come from the last forward of a tapped module, or from
running an example input through a private copy of the model (no user hook, no tap, no change
to buffers or to the random number generator).

Here: the public calls and reading what is drawn into a :class:`~fxprobe.present.viz_items.Scene`;
``_viz_items`` turns a scene into items and edges, ``_viz_dot`` emits the DOT text.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ..core.errors import ConfigError, RenderError
from ..core.options import TracerKind, check_choice
from ..core.select import as_selectors, select
from ..core.site import Site, node_site, sites_of
from ..frontends.fx import Plan, plan
from ..frontends.mirror import drop_overrides, mirror
from ..runtime.program import check_model
from .shapes import propagate
from .summary import describe_value
from .viz_dot import draw
from .viz_items import Scene, newest

if TYPE_CHECKING:
    import graphviz

    from ..frontends.dynamo import CapturedGraph

SUFFIXES = ("svg", "png", "pdf", "dot", "gv")
"""File suffixes ``render`` writes; ``dot`` and ``gv`` need no Graphviz program."""

_INSTALL_HINT = (
    "install Graphviz (apt install graphviz, brew install graphviz, or "
    "conda install -c conda-forge graphviz) so that 'dot' is on PATH, "
    "or write a .dot file, which needs no Graphviz program"
)


def to_dot(obj: nn.Module, example_input: Any = None, *,
           example_kwargs: Mapping[str, Any] | None = None, ops: Any = None,
           depth: int | None = None, tracer: TracerKind = "auto", train: bool | None = None,
           rankdir: str = "TB", show_plumbing: bool = False) -> graphviz.Digraph:
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
            are listed in one small node without edges. A tapped site is always drawn.

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
    graphviz = _import_graphviz()
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise ConfigError(f"depth={depth!r} is not accepted; pass an int >= 0, or None")
    if rankdir not in ("TB", "LR", "BT", "RL"):
        raise ConfigError(f"rankdir={rankdir!r} is not accepted; use 'TB', 'LR', 'BT' or 'RL'")
    scene = _scene(obj, ops=ops, tracer=tracer, train=train)
    if example_input is not None or example_kwargs:
        args = _as_args(example_input)
        if scene.run is not None:  # a deployed artifact: run a tapped copy of it
            infos = {k: describe_value(v)
                     for k, v in scene.run(args, dict(example_kwargs or {})).items()}
        else:
            infos = propagate(scene.plan, scene.root, args, dict(example_kwargs or {}))
        scene.infos.update(infos)
        scene.ran = True
    return draw(graphviz, scene, depth, rankdir, show_plumbing)


def render(obj: nn.Module, path: str | Path, **kwargs: Any) -> Path:
    """Write the picture of ``to_dot(obj, **kwargs)`` to ``path``, in the format of its suffix.

    ``.svg``, ``.png`` and ``.pdf`` are rendered by the Graphviz ``dot`` program; ``.dot`` (or
    ``.gv``) is the DOT text, which needs no Graphviz program.

    Returns:
        The path written.

    Raises:
        ConfigError: an unknown suffix. RenderError: ``dot`` is missing or fails.
    """
    path = Path(path)
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in SUFFIXES:
        raise ConfigError(
            f"cannot tell the format of {str(path)!r} from its suffix; end the file name in "
            + ", ".join("." + s for s in SUFFIXES)
        )
    if not path.parent.is_dir():
        raise RenderError(
            f"cannot write {str(path)!r}: the folder {str(path.parent)!r} does not exist; "
            "create it first or pass a path in an existing folder"
        )
    dot = to_dot(obj, **kwargs)
    data = (dot.source.encode("utf-8") if suffix in ("dot", "gv")
            else pipe(dot, suffix, str(path)))
    try:
        path.write_bytes(data)
    except OSError as e:
        raise RenderError(f"cannot write {str(path)!r}: {e.strerror or e}") from e
    return path


def pipe(dot: graphviz.Digraph, fmt: str, what: str = "the picture") -> bytes:
    """Run the ``dot`` program on ``dot``'s source; a :class:`RenderError` says how to fix it."""
    graphviz = _import_graphviz()
    if shutil.which("dot") is None:
        raise RenderError(f"writing {what} needs the Graphviz 'dot' program, which is not on "
                          f"PATH; {_INSTALL_HINT}")
    try:
        data: bytes = dot.pipe(format=fmt)
    except graphviz.ExecutableNotFound as e:
        raise RenderError(f"writing {what} needs the Graphviz 'dot' program; "
                          f"{_INSTALL_HINT}") from e
    except graphviz.CalledProcessError as e:
        err = (e.stderr or b"").decode(errors="replace").strip().splitlines()
        raise RenderError(f"Graphviz 'dot' failed writing {what}: "
                          f"{err[0] if err else e}") from e
    return data


def _import_graphviz() -> Any:
    try:
        import graphviz
    except ImportError as e:  # a declared dependency, but an optional feature
        raise ImportError("fxprobe.to_dot needs the graphviz package: pip install graphviz "
                          f"(and, to render pictures, the Graphviz program: {_INSTALL_HINT})"
                          ) from e
    return graphviz


# -- what to draw ---------------------------------------------------------------------------

def _scene(obj: nn.Module, *, ops: Any, tracer: TracerKind, train: bool | None) -> Scene:
    from ..runtime.artifact import TappedArtifact, artifact_kind

    if artifact_kind(obj) is not None or isinstance(obj, TappedArtifact):
        return _artifact_scene(obj, ops=ops, tracer=tracer, train=train)
    view = getattr(obj, "_fxprobe_view", None)
    if view is not None:
        given = [n for n, v in (("ops", ops), ("train", train)) if v is not None]
        given += ["tracer"] if tracer != "auto" else []
        if given:
            raise ConfigError(
                f"{', '.join(given)} cannot be given with a TappedModule, which is drawn with "
                "its own selection, tracer and mode; pass the model instead, or "
                "change the tapped module (fxprobe.tap(model, ops=...), tapped.train())"
            )
        v = view()
        graphs = newest(v.graphs)
        scene = Scene(v.title, v.plan, v.root, _drawn(v.plan, v.selected, graphs.values()), {},
                      v.capture, graphs=graphs)
        for info in v.captures:
            scene.dynamo[info.path] = sum(
                1 for s in v.selected if s.how == "dynamo" and (
                    not info.path or s.module_path == info.path
                    or s.module_path.startswith(info.path + ".")))
        if v.taps is not None:
            scene.infos.update({name: describe_value(v.taps[name]) for name in v.taps})
        return scene
    obj = check_model(obj, "fxprobe.to_dot")
    check_choice("tracer", tracer, TracerKind)
    root = mirror(obj)
    drop_overrides(root)
    training = obj.training if train is None else bool(train)
    root.train(training)
    p = plan(root, tracer=tracer)
    chosen: list[Site] = []
    if ops is not None:
        mode = "train" if training else "eval"
        chosen = select(p.sites, as_selectors(ops), context=f"{type(obj).__name__} ({mode} mode)",
                        fallbacks=p.fallbacks)
    return Scene(f"{type(obj).__name__} ({'train' if training else 'eval'} mode)", p, root,
                  _drawn(p, chosen), {})


def _artifact_scene(obj: Any, *, ops: Any, tracer: TracerKind, train: bool | None) -> Scene:
    """A ScriptModule or ExportedProgram (or what fxprobe.tap made of one), as a scene."""
    from ..runtime.artifact import TappedArtifact, artifact_kind
    from .artifact_viz import export_picture, script_picture

    given = ["train"] if train else []  # drawn in the mode the artifact is in
    given += ["tracer"] if tracer != "auto" else []
    tapped = obj if isinstance(obj, TappedArtifact) else None
    given += ["ops"] if ops is not None and tapped is not None else []
    if given:
        raise ConfigError(
            f"{', '.join(given)} cannot be given for a TorchScript module or an exported "
            "program, which is drawn from its graph as it is (and a tapped one with its own "
            "selection)")
    source = tapped.source if tapped is not None else obj
    if source is None:
        raise ConfigError(
            "this tapped artifact was loaded from a file and no longer holds the program it "
            "was made from; draw the original (fxprobe.to_dot(program, ops=...))")
    pic = script_picture(source) if artifact_kind(source) == "script" else export_picture(
        source)
    p = pic.plan
    if tapped is not None:
        chosen: Sequence[Site] = tapped.sites
    elif ops is not None:
        chosen = select(p.sites, as_selectors(ops), context=pic.title)
    else:
        chosen = []
    scene = Scene(pic.title, p, pic.root, _drawn(p, chosen), {}, run=pic.run)
    if tapped is not None:
        taps = tapped.taps
        scene.infos.update({name: describe_value(taps[name]) for name in taps})
    return scene


def _drawn(p: Plan, selected: Sequence[Site],
           graphs: Iterable[Sequence[CapturedGraph]] = ()) -> frozenset[str]:
    """The names drawn as tapped: a module call fx (or dynamo) traced through marks its last
    node."""
    names = {s.name for s in selected}
    drawn = [r.graph for r in p.regions.values()] + [g.graph for gs in graphs for g in gs]
    for graph in drawn:
        for node in graph.nodes:
            own = node_site(node)
            if own is not None and any(s.inlined and s.name in names for s in sites_of(node)):
                names.add(own.name)
    return frozenset(names)


def _as_args(example_input: Any) -> tuple[Any, ...]:
    if example_input is None:
        return ()
    if isinstance(example_input, tuple):
        return example_input
    return (example_input,)
