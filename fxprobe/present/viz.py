"""Graph export: a model's sites as a Graphviz picture, tapped sites and hook fallbacks marked.

``to_dot`` draws the plan fxprobe makes of a model: every traced region's fx graph (one node per
site, edges for data flow), the modules that run as written because ``torch.fx`` could not trace
them (with the reason in a tooltip) and the hook sites inside them, all nested in clusters that
follow the module hierarchy. Shapes come from the last forward of a tapped module, or from
running an example input through a private copy of the model (no user hook, no tap, no change
to buffers or to the random number generator).

Here: reading a :class:`~fxprobe.core.view.View` (which ``fxprobe.runtime.views`` makes of what
``fxprobe.to_dot`` is given) into a :class:`~fxprobe.present.viz_items.Scene`, and writing the
picture; ``viz_items`` turns a scene into items and edges, ``viz_dot`` emits the DOT text.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigError, RenderError
from ..core.names import did_you_mean
from ..core.site import Site, node_site, sites_of
from ..core.view import CapturedGraph, Plan, View
from .summary import describe_value
from .viz_dot import draw
from .viz_items import Scene, newest

if TYPE_CHECKING:
    import graphviz

SUFFIXES = ("svg", "png", "pdf", "dot", "gv")
"""File suffixes ``render`` writes; ``dot`` and ``gv`` need no Graphviz program."""

_INSTALL_HINT = (
    "install Graphviz (apt install graphviz, brew install graphviz, or "
    "conda install -c conda-forge graphviz) so that 'dot' is on PATH, "
    "or write a .dot file, which needs no Graphviz program"
)


def to_dot(view: View, example_input: Any = None, *,
           example_kwargs: Mapping[str, Any] | None = None, depth: int | None = None,
           rankdir: str = "TB", show_plumbing: bool = False,
           focus: str | None = None, fold: bool = True) -> graphviz.Digraph:
    """Draw ``view`` as a ``graphviz.Digraph`` (see ``fxprobe.to_dot``, which hands this the
    view of a model, a tapped module or an artifact).

    Args:
        view: what to draw; its ``plan`` must be set.
        example_input: a tensor or a tuple of positional arguments whose shapes are noted at
            every site, by ``view.shapes`` (which changes nothing of the user's).
        example_kwargs: keyword arguments for that run.
        depth, rankdir, show_plumbing, focus, fold: as for ``fxprobe.to_dot``.

    Raises:
        ConfigError: a bad ``depth``, ``rankdir``, ``focus`` or ``fold``; an example input
            for a view that runs none.
    """
    graphviz = check_drawing(depth, rankdir, fold)
    if view.plan is None or view.root is None:
        raise ConfigError(f"{view.title or 'this'} has no graph to draw; draw the model")
    scene = _scene(view, view.plan, view.root)
    if focus is not None:
        check_focus(focus, view.root)
        if depth is None:  # the focus whole, its siblings (and theirs) one node each
            depth = max(focus.count("."), 0)
    if example_input is not None or example_kwargs:
        if view.shapes is None:
            raise ConfigError(f"{view.title} cannot run an example input")
        scene.infos.update(view.shapes(_as_args(example_input), dict(example_kwargs or {})))
        scene.ran = True
    return draw(graphviz, scene, depth, rankdir, show_plumbing, focus, fold)


def check_focus(focus: Any, root: Any) -> None:
    """``focus`` must name a submodule of ``root`` (the model drawn).

    Raises:
        ConfigError: it does not, with the closest module paths.
    """
    paths = [n for n, _ in root.named_modules() if n]
    if isinstance(focus, str) and focus in paths:
        return
    hint = did_you_mean(str(focus), paths) or (
        " Pass the path of a submodule, as fxprobe.sites(model) prints it (blocks.3).")
    raise ConfigError(f"focus={focus!r} is not a module of {type(root).__name__}.{hint}")


def check_drawing(depth: int | None, rankdir: str, fold: bool = True) -> Any:
    """The ``graphviz`` package, once ``depth``, ``rankdir`` and ``fold`` are known to be
    good."""
    graphviz = _import_graphviz()
    if not isinstance(fold, bool):
        raise ConfigError(f"fold={fold!r} is not accepted; pass True (fold repeated blocks, "
                          "the default) or False (draw every block)")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise ConfigError(f"depth={depth!r} is not accepted; pass an int >= 0, or None")
    if rankdir not in ("TB", "LR", "BT", "RL"):
        raise ConfigError(f"rankdir={rankdir!r} is not accepted; use 'TB', 'LR', 'BT' or 'RL'")
    return graphviz


def render(view: View, path: str | Path, **kwargs: Any) -> Path:
    """Write the picture of ``to_dot(view, **kwargs)`` to ``path``, in the format of its suffix
    (see ``fxprobe.render``).

    Returns:
        The path written.

    Raises:
        ConfigError: an unknown suffix. RenderError: ``dot`` is missing or fails.
    """
    path = check_path(path)
    return write(to_dot(view, **kwargs), path)


def check_path(path: str | Path) -> Path:
    """``path`` as a ``Path``, once its suffix names a format and its folder exists.

    ``.svg``, ``.png`` and ``.pdf`` are rendered by the Graphviz ``dot`` program; ``.dot`` (or
    ``.gv``) is the DOT text, which needs no Graphviz program.

    Raises:
        ConfigError: an unknown suffix. RenderError: the folder does not exist.
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
    return path


def write(dot: graphviz.Digraph, path: Path) -> Path:
    """Write ``dot`` to ``path`` (checked by :func:`check_path`) in the format of its suffix."""
    suffix = path.suffix.lower().lstrip(".")
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

def _scene(v: View, plan: Plan, root: Any) -> Scene:
    """What to draw of ``v`` (``plan`` and ``root`` are its own): the sites drawn as tapped,
    the values it holds."""
    graphs = newest(v.graphs)
    scene = Scene(v.title, plan, root, _drawn(plan, v.selected, graphs.values()), {},
                  v.capture, graphs=graphs, artifact=v.artifact, selected=v.selected)
    for info in v.dynamo_info:
        scene.dynamo[info.path] = sum(
            1 for s in v.selected if s.how == "dynamo" and (
                not info.path or s.module_path == info.path
                or s.module_path.startswith(info.path + ".")))
    if v.taps is not None:
        scene.infos.update({name: describe_value(v.taps[name]) for name in v.taps})
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
