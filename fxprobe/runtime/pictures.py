"""The views the pictures draw of what is drawn as it is: a deployed artifact, read from its graph
(and tapped to run an example input), and a tapped module or artifact, whose selection, tracer
and mode are its own (the keywords of ``fxprobe.to_dot`` that would plan it again are refused).

``runtime.artifact`` and ``runtime.tapped`` call this from their ``render``, so it imports
neither: how to tap an artifact comes in as an argument (``runtime.artifact.tap_artifact``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from ..core.errors import ConfigError
from ..core.options import TAP_DEFAULTS
from ..core.select import select_ops
from ..core.view import ValueInfo, View
from ..frontends.export import ExportGraph
from ..frontends.script import ScriptGraph, quiet_jit
from ..present.artifact_viz import picture
from ..present.summary import describe_value
from ..present.viz import check_drawing, check_path, to_dot, write

TapArtifact = Callable[..., Any]
"""``runtime.artifact.tap_artifact(model, ops, **options)``: a tapped copy of an artifact."""



class _Viewed(Protocol):
    def view(self) -> View: ...


class _TappedArtifact(Protocol):
    source: Any

    def view(self) -> View: ...


def artifact_view(source: Any, tap: TapArtifact, *, ops: Any = None,
                  tapped: View | None = None) -> View:
    """A ScriptModule or ExportedProgram as a picture: one graph of its sites.

    Args:
        source: the artifact (never changed).
        tap: how to tap it, to run an example input (see :data:`TapArtifact`).
        ops: the sites to mark as tapped (any ``ops=`` of ``fxprobe.tap``); None marks none.
        tapped: the view of a tapped copy of ``source``: its sites are marked, its values shown.
    """
    if isinstance(source, torch.jit.ScriptModule):
        with quiet_jit():
            sg = ScriptGraph(source)
        title = f"{source.original_name} (TorchScript)"
        plan, root = picture(sg.sites, list(sg.values.values()), _script_inputs,
                             lambda v: v.unique())
    else:
        eg = ExportGraph(source)
        title = "ExportedProgram (torch.export)"
        plan, root = picture(eg.sites, list(eg.nodes.values()), lambda n: n.all_input_nodes,
                             lambda n: n)

    def shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, ValueInfo]:
        run = tap(source, None, **TAP_DEFAULTS)  # every site's value, as is
        try:
            run(*args, **kwargs)
        except Exception as e:  # as an eager model's example input is refused (runtime.shapes)
            shown = ", ".join(describe_value(a).label or type(a).__name__ for a in args)
            raise ConfigError(
                f"the example input ({shown}) does not run through {title}: {_last_error(e)}; "
                "pass inputs its forward accepts (the shapes and dtypes it was saved for)"
            ) from e
        return {name: describe_value(value) for name, value in dict(run.taps).items()}

    if tapped is not None:
        selected, taps = tapped.selected, tapped.taps
    else:
        selected = tuple(select_ops(plan.sites, ops, context=title)) if ops is not None else ()
        taps = None
    return View(title, tuple(plan.sites), selected, tapped=tapped is not None, taps=taps,
                plan=plan, root=root, artifact=True, shapes=shapes)


def _script_inputs(value: Any) -> list[Any]:
    """What a TorchScript value is computed from: its node's inputs, and for a node with blocks
    (``prim::If``: an in-place ``ReLU`` is one, ``prim::Loop``) what its blocks return, whose
    data flow the node's own inputs (the condition) do not show."""
    node = value.node()
    found = list(node.inputs())
    for block in node.blocks():
        found += list(block.outputs())
    return found


def _last_error(e: BaseException) -> str:
    """One line of an artifact's error: TorchScript's message ends in the Python error it
    raised (``RuntimeError: Expected 4D input ...``) after a traceback of the scripted code."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    named = [x for x in lines if re.match(r"[A-Z]\w*(Error|Exception): ", x)]
    text = named[-1] if named else (f"{type(e).__name__}: {lines[0]}" if lines
                                    else type(e).__name__)
    return text if len(text) <= 300 else text[:297] + "..."


def tapped_artifact_view(tapped: _TappedArtifact, tap: TapArtifact) -> View:
    """The picture of a tapped artifact: the artifact it was made from, its sites marked."""
    if tapped.source is None:
        raise ConfigError(
            "this tapped artifact was loaded from a file and no longer holds the program it "
            "was made from; draw the original (fxprobe.to_dot(program, ops=...))")
    return artifact_view(tapped.source, tap, tapped=tapped.view())


def refuse_for_module(ops: Any, tracer: Any, train: Any) -> None:
    """A TappedModule is drawn with its own selection, tracer and mode."""
    given = [n for n, v in (("ops", ops), ("train", train)) if v is not None]
    given += ["tracer"] if tracer != "auto" else []
    if given:
        raise ConfigError(
            f"{', '.join(given)} cannot be given with a TappedModule, which is drawn with "
            "its own selection, tracer and mode; pass the model instead, or "
            "change the tapped module (fxprobe.tap(model, ops=...), tapped.train())"
        )


def refuse_for_artifact(ops: Any, tracer: Any, train: Any, *, tapped: bool) -> None:
    """An artifact is drawn from its graph as it is, in its mode (a tapped one with its own
    selection)."""
    given = ["train"] if train else []
    given += ["tracer"] if tracer != "auto" else []
    given += ["ops"] if ops is not None and tapped else []
    if given:
        raise ConfigError(
            f"{', '.join(given)} cannot be given for a TorchScript module or an exported "
            "program, which is drawn from its graph as it is (and a tapped one with its own "
            "selection)")


def render_module(tapped: _Viewed, path: str | Path, kwargs: dict[str, Any]) -> Path:
    """``tapped.render(path, **kwargs)`` of a TappedModule (see ``fxprobe.render``)."""
    return _render(tapped.view, path, kwargs, refuse_for_module)


def render_artifact(tapped: _TappedArtifact, path: str | Path, kwargs: dict[str, Any],
                    tap: TapArtifact) -> Path:
    """``tapped.render(path, **kwargs)`` of a TappedArtifact (see ``fxprobe.render``)."""
    def refuse(ops: Any, tracer: Any, train: Any) -> None:
        refuse_for_artifact(ops, tracer, train, tapped=True)

    return _render(lambda: tapped_artifact_view(tapped, tap), path, kwargs, refuse)


def _render(view: Callable[[], View], path: str | Path, kwargs: dict[str, Any],
            refuse: Callable[[Any, Any, Any], None]) -> Path:
    # In the order fxprobe.render checks: the path, the drawing options, then what is drawn.
    path = check_path(path)
    kwargs = dict(kwargs)
    check_drawing(kwargs.get("depth"), kwargs.get("rankdir", "TB"), kwargs.get("fold", True))
    refuse(kwargs.pop("ops", None), kwargs.pop("tracer", "auto"), kwargs.pop("train", None))
    return write(to_dot(view(), **kwargs), path)
