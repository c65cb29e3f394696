"""Tapped deployed artifacts: what ``fxprobe.tap`` returns for a ScriptModule or an ExportedProgram.

Both frontends build a new artifact whose forward returns the model's output and the tapped
values: ``(output, (values...))`` named by the ScriptModule's ``fxprobe_names`` attribute, and
``(output, {site name: value})`` for a program; the classes here run it, keep what it returns
(history, offload, statistics) and read it back like :class:`fxprobe.TappedModule` does.
Capture modes that would need Python at every tap (``fn=``, ``grad=``, ``reduce=`` with a
function) cannot live in a saved graph and are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import fx

from ..capture.pipeline import Pipeline
from ..core.errors import ConfigError, RemovedError, UnsupportedModelError
from ..core.options import TapKwargs, TapOptions, arguments, make_options
from ..core.record import Recording, Taps
from ..core.select import select_ops
from ..core.site import Site
from ..core.view import View, Viewable
from ..frontends.export import export_graph, export_sites, saved_taps
from ..frontends.export import rewrite as rewrite_export

_DEFAULTS: dict[str, Any] = {
    "capture": "output", "tracer": "auto", "leaf_modules": (), "autowrap_functions": (),
    "fn": None, "grad": False, "grad_fn": None, "gather": False,
}
_WHY = {
    "capture": "only a site's output is captured from a deployed graph (tap the sites that "
               "produce the inputs instead)",
    "tracer": "a TorchScript or torch.export graph is read as it is, never traced",
    "leaf_modules": "a TorchScript or torch.export graph is read as it is, never traced",
    "autowrap_functions": "a TorchScript or torch.export graph is read as it is, never traced",
    "fn": "a saved graph cannot call a Python function at each tap",
    "grad": "gradient hooks are Python callbacks, which a saved graph cannot hold; run "
            "backward on the tapped values yourself with detach=False",
    "grad_fn": "gradient hooks are Python callbacks, which a saved graph cannot hold",
    "gather": "a saved graph's values are gathered by no tensor-parallel layer fxprobe sees; "
              "tap the model itself",
}


def artifact_kind(model: Any) -> str | None:
    """``"script"``, ``"export"`` or None (an ordinary module)."""
    if isinstance(model, torch.jit.ScriptModule):
        return "script"
    try:
        from torch.export import ExportedProgram
    except ImportError:  # pragma: no cover - torch < 2.1
        return None
    return "export" if isinstance(model, ExportedProgram) else None


def artifact_options(kind: str, **kwargs: Any) -> TapOptions:
    """Validate ``fxprobe.tap``'s arguments, then refuse what a deployed graph cannot do."""
    kwargs = arguments(TapKwargs, kwargs, "fxprobe.tap")
    options = make_options(**kwargs)
    for key, default in _DEFAULTS.items():
        value = kwargs[key]
        if value is not default and value != default:
            what = "TorchScript modules" if kind == "script" else "torch.export programs"
            raise ConfigError(f"{key}={value!r} is not supported for {what}: {_WHY[key]}")
    if options.reduce is not None and options.reduce != "stats":
        shown = getattr(options.reduce, "__name__", options.reduce)
        raise ConfigError(
            f"reduce={shown!r} is not supported for deployed graphs, which cannot call Python "
            "at each tap or carry a sampling seed; use reduce='stats' or reduce the taps "
            "yourself after each forward")
    return options


class TappedArtifact(Viewable):
    """A tapped deployed artifact: call it like the model; ``taps`` holds the last forward."""

    def __init__(self, run: Callable[..., Any], names: Sequence[str], sites: Sequence[Site],
                 options: TapOptions, copied: frozenset[str] = frozenset(),
                 outplaced: frozenset[str] = frozenset()) -> None:
        self._run = run
        self._names = tuple(names)
        by_name = {s.name: s for s in sites}
        self._sites = tuple(by_name[n] for n in self._names)
        self._options = options
        self.copied = copied
        """Names of the sites copied before a later in-place op overwrites them."""
        self.outplaced = outplaced
        """Names of the sites kept safe by running, out of place, the one in-place op that
        would overwrite them (``aten::relu_`` as ``aten::relu``): no copy needed."""
        self._order = {n: i for i, n in enumerate(self._names)}
        self._rec = Recording(options)  # capture="output": a deployed graph refuses others
        # The fx frontend's pipeline, after the graph: what the artifact hands back is kept
        # (reduced, offloaded, detached) exactly as a traced region's tuple is.
        self._pipeline = Pipeline(options, self._rec, by_name.get)
        self._rec.finalize = self._pipeline.finalize
        self._removed = False
        self.source: Any = None
        """The artifact that was tapped, when fxprobe made this one from it (for drawing)."""
        self._sink = options.sink  # fxprobe.Disk: write(values, inputs) after each forward
        if self._sink is not None:
            self._sink.attach(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._removed:
            raise RemovedError("this tapped artifact was removed; call fxprobe.tap(...) again")
        out, values = self._split(self._run(*args, **kwargs))
        pipeline = self._pipeline
        state = self._rec.begin(frozenset())
        try:
            ran = [(n, v) for n, v in zip(self._names, values, strict=True) if v is not None]
            names = tuple(n for n, _ in ran)
            # The graph copied what a later in-place op would overwrite: no copy here.
            pipeline.store(names, tuple(pipeline.keep(v, False) for _, v in ran))
            if state.frame.deferred:
                pipeline.finish(state.frame)
        finally:
            state.active = False
        if self._sink is not None:
            self._sink.write(self._rec.values(state.frame), (args, kwargs))
        return out

    forward = __call__

    def parameters(self) -> Iterator[torch.Tensor]:
        """The artifact's parameters (what ``to=fxprobe.Disk`` copies a value out of)."""
        module: Any = self._run  # a ScriptModule, or the program's module()
        return iter(module.parameters())

    def buffers(self) -> Iterator[torch.Tensor]:
        """The artifact's buffers (what ``to=fxprobe.Disk`` copies a value out of)."""
        module: Any = self._run
        return iter(module.buffers())

    def _split(self, result: Any) -> tuple[Any, Sequence[Any]]:
        out, values = result
        return out, values

    def intervene(self, fns: Any) -> NoReturn:
        """Refused (:class:`ConfigError`): a saved graph cannot call Python at its sites."""
        raise ConfigError(self._per_call("tapped.intervene()"))

    def run_with_cache(self, *args: Any, names: Any = None, **kwargs: Any) -> NoReturn:
        """Refused (:class:`ConfigError`): a saved graph cannot call Python at its sites."""
        raise ConfigError(self._per_call("tapped.run_with_cache()"))

    def _per_call(self, what: str) -> str:
        return (f"{what} needs a call into Python at each site of the graph as it runs, and "
                f"a {self._kind} runs its saved graph without one, tapped only at the sites "
                "fxprobe.tap(artifact, ops=...) chose (their values are in tapped.taps after "
                "each call). To edit or keep any site per call, tap the Python model it was "
                "made from: fxprobe.tap(model).intervene({...}) / .run_with_cache(...)")

    _kind = "deployed artifact"

    @property
    def taps(self) -> Taps:
        """The values the last forward captured, by site name (a branch not taken is absent)."""
        return Taps(self._rec, self._order)

    @property
    def history(self) -> list[Taps]:
        """The kept forwards (``keep=``), oldest first; the last one is ``taps``."""
        return [Taps(self._rec, self._order, frame) for frame in self._rec.history()]

    @property
    def sites(self) -> tuple[Site, ...]:
        """The selected sites, in the order of the taps tuple the artifact returns."""
        return self._sites

    def view(self) -> View:
        """What the tables read: the selected sites and what the last forward captured (the
        pictures draw the artifact it was made from: ``fxprobe.runtime.pictures``)."""
        return View("", self.sites, self.sites, tapped=True, taps=self.taps)

    def summary(self, fmt: str = "text") -> Any:
        """A :class:`fxprobe.Table` of the selected sites and what the last forward captured."""
        from ..present.summary import summary

        return summary(self.view(), fmt)

    def render(self, path: str | Path, **kw: Any) -> Path:
        """Draw the artifact's sites, the tapped ones marked, to ``path`` (see ``to_dot``)."""
        from .pictures import render_artifact

        return render_artifact(self, path, kw, tap_artifact)

    def remove(self) -> None:
        """Stop: later calls raise RemovedError; the last values stay readable; a ``to=Disk``
        is flushed and closed (raises if its writer failed)."""
        self._removed = True
        if self._sink is not None:
            self._sink.close()

    def __enter__(self) -> TappedArtifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sites={len(self._names)})"


class TappedScript(TappedArtifact):
    """A tapped TorchScript module (``fxprobe.tap(script_module)``).

    ``script_module`` is itself a ScriptModule, savable with ``torch.jit.save``: its forward
    returns ``(output, (values...))`` in the order of its ``fxprobe_names`` attribute.
    """

    _kind = "TorchScript module"

    def __init__(self, module: Any, sites: Sequence[Site],
                 options: TapOptions, graph: Any = None,
                 copied: frozenset[str] = frozenset(),
                 outplaced: frozenset[str] = frozenset()) -> None:
        names = list(module.fxprobe_names)
        super().__init__(module, names, sites, options, copied, outplaced)
        self._module = module
        self._graph = graph

    @property
    def script_module(self) -> torch.jit.ScriptModule:
        """The tapped ScriptModule: ``torch.jit.save(tapped.script_module, "tapped.pt")``."""
        return self._module

    @property
    def graph(self) -> Any:
        """The rewritten, inlined TorchScript graph (``torch._C.Graph``)."""
        return self._graph if self._graph is not None else self._module.graph

    def save(self, path: str | Path) -> Path:
        """``torch.jit.save`` the tapped ScriptModule to ``path``; return the ``Path``."""
        from ..frontends.script import quiet_jit

        with quiet_jit():
            torch.jit.save(self._module, str(path))
        return Path(path)


def tap_script(model: torch.jit.ScriptModule, ops: Any, options: TapOptions) -> TappedScript:
    from ..frontends.script import ScriptGraph, quiet_jit
    from ..frontends.script_build import build_module, is_tapped, rewrite, saved_sites

    if is_tapped(model):  # fxprobe built it (maybe saved and loaded): read what it returns
        if ops is not None:
            raise ConfigError(
                "this ScriptModule was already tapped by fxprobe (it has fxprobe_names); "
                "pass ops=None to read its taps, or tap the original module again")
        sites = saved_sites(model)
        if model.fxprobe_reduce == "stats" and options.reduce != "stats":
            options = dataclasses.replace(options, reduce="stats")
        loaded = TappedScript(model, sites, options)
        loaded.source = model.model  # the tapped module holds the original as `model`
        return loaded
    _check_script(model)
    with quiet_jit():
        sg = ScriptGraph(model)
    chosen = select_ops(sg.sites, ops, context=f"{model.original_name} (TorchScript)")
    rewritten = rewrite(sg, chosen, copy=options.copy)
    module = build_module(model, rewritten, sg.sites, "stats" if options.reduce else "")
    tapped = TappedScript(module, sg.sites, options, rewritten.graph, rewritten.copied,
                          rewritten.outplaced)
    tapped.source = model
    return tapped


def _check_script(model: torch.jit.ScriptModule) -> None:
    if not model._c._has_method("forward"):
        raise UnsupportedModelError(
            f"{model.original_name} has no forward method; fxprobe taps a ScriptModule's forward")
    for path, m in model.named_modules():
        if m._c._get_forward_hooks() or m._c._get_forward_pre_hooks():
            raise UnsupportedModelError(
                f"module {path or '<top>'!r} of this ScriptModule has scripted forward hooks, "
                "which fxprobe's inlined forward would skip; script the model without them")


def script_sites(model: torch.jit.ScriptModule) -> list[Site]:
    from ..frontends.script import ScriptGraph, quiet_jit
    from ..frontends.script_build import is_tapped, saved_sites

    if is_tapped(model):
        return saved_sites(model)
    _check_script(model)
    with quiet_jit():
        return ScriptGraph(model).sites


class TappedExport(TappedArtifact):
    """A tapped torch.export program (``fxprobe.tap(exported_program)``).

    ``exported()`` is the tapped ``ExportedProgram``: save it with ``torch.export.save``; its
    ``module()`` returns ``(output, {site name: value})``, in the order of :attr:`sites`, and
    the names are in its output structure (``ep.call_spec.out_spec.child(1).context``), so a
    reader without fxprobe finds them. (A program tapped by fxprobe before the values were
    named returns ``(output, (values...))``; it is read the same way.)
    """

    _kind = "torch.export program"

    def __init__(self, program: Any, sites: Sequence[Site], options: TapOptions,
                 copied: frozenset[str] = frozenset(),
                 outplaced: frozenset[str] = frozenset()) -> None:
        self._program = program
        module = program.module()
        super().__init__(module, [s.name for s in sites], sites, options, copied,
                         outplaced)

    def _split(self, result: Any) -> tuple[Any, Sequence[Any]]:
        out, values = result
        if isinstance(values, dict):  # named by site (older tapped programs: a tuple)
            return out, [values[n] for n in self._names]
        return out, values

    def exported(self) -> Any:
        """The tapped ``ExportedProgram`` (``torch.export.save(tapped.exported(), "t.pt2")``)."""
        return self._program

    @property
    def graph_module(self) -> fx.GraphModule:
        """The tapped program's graph module (lifted parameters are placeholders)."""
        gm: fx.GraphModule = self._program.graph_module
        return gm


def tap_export(ep: Any, ops: Any, options: TapOptions) -> TappedExport:
    saved = saved_taps(ep)
    if saved is not None:
        if ops is not None:
            raise ConfigError(
                "this ExportedProgram was already tapped by fxprobe; pass ops=None to read its "
                "taps, or tap the original program again")
        return TappedExport(ep, saved, options)
    if options.copy not in ("auto", "always", "never"):
        raise ConfigError(f"copy={options.copy!r} is not accepted")
    eg = export_graph(ep)
    sites = eg.sites
    chosen = select_ops(sites, ops, context="the exported program")
    program, names, copied, outplaced = rewrite_export(eg, chosen, options.copy)
    by_name = {s.name: s for s in sites}
    tapped = TappedExport(program, [by_name[n] for n in names], options, copied, outplaced)
    tapped.source = ep
    return tapped


def tap_artifact(model: Any, ops: Any, **kwargs: Any) -> TappedArtifact:
    """``fxprobe.tap`` for a ScriptModule or an ExportedProgram."""
    kind = artifact_kind(model)
    options = artifact_options(kind or "", **kwargs)
    if kind == "script":
        return tap_script(model, ops, options)
    if kind == "export":
        return tap_export(model, ops, options)
    raise UnsupportedModelError(f"{type(model).__name__} is neither a ScriptModule nor an "
                                "ExportedProgram")


def artifact_sites(model: Any, **given: Any) -> list[Site]:
    """``fxprobe.sites`` for a ScriptModule or an ExportedProgram.

    ``given``: the tracing arguments of ``fxprobe.sites`` that were not left at their
    defaults, refused (the graph is read as it is, in the mode it is in).
    """
    if given:
        raise ConfigError(
            f"{', '.join(f'{k}={v!r}' for k, v in given.items())} cannot be given for a "
            "TorchScript module or an exported program: its graph is read as it is (switch a "
            "ScriptModule's mode with .train()/.eval() before listing)")
    if artifact_kind(model) == "script":
        from ..frontends.script_build import is_tapped

        sites, tapped = script_sites(model), is_tapped(model)
    else:
        sites, tapped = export_sites(model), saved_taps(model) is not None
    if tapped:  # each site is a value it returns (a module call too): every one is listed
        sites = [s if s.listed else dataclasses.replace(s, listed=True) for s in sites]
    return sites
