"""The runtime: ``TappedModule``, what ``fxprobe.tap`` returns for a model (``_api``); its
programs are built per mode (train/eval) on first use, installed, run and read here."""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import fx, nn

from ..capture.pipeline import Pipeline
from ..core.errors import CaptureError, ConfigError, RemovedError
from ..core.names import one_line
from ..core.options import TapOptions
from ..core.record import Grads, Recording, Taps
from ..core.select import Selector
from ..core.site import Site
from ..core.view import Viewable
from ..frontends.dynamo import CaptureInfo, DynamoRegion, dynamo_failed
from ..frontends.fx import Fallback
from ..frontends.hooks import HookSet
from ..frontends.mirror import (
    HookWatch,
    adopt,
    count_changes,
    drop_overrides,
    install_override,
    mirror,
    own_forward,
    user_hooks,
)
from .intervene import Cache, Intervention, run_with_cache
from .program import Program, View, build_program, captures_of, check_found, graphs_of
from .shapes import propagate

if TYPE_CHECKING:

    from ..present.summary import Table


class TappedModule(nn.Module, Viewable):
    """The model, rewritten so that the selected sites are captured at every forward.

    It shares parameters and buffers with the model (training it trains the model; converting
    it with ``.double()``, ``.to(device)`` converts the model, and the other way round) and
    leaves the model object itself untouched. ``tapped.taps`` holds the last forward's values
    of the calling thread.
    """

    _root: nn.Module
    _selectors: list[Selector] | None
    _options: TapOptions
    _model_name: str
    _rec: Recording
    _pipeline: Pipeline
    _hookset: HookSet
    _programs: dict[bool, Program]
    _root_hooked: bool
    _changes: list[int]
    _structure: int
    _removed: bool
    _sink: Any

    def __init__(self, model: nn.Module, selectors: list[Selector] | None,
                 options: TapOptions) -> None:
        super().__init__()
        root = mirror(model)
        d = self.__dict__
        d["_root"] = root
        # The copied root's containers: state_dict keys and parameters are the model's.
        d["_modules"] = root._modules
        d["_parameters"] = root._parameters
        d["_buffers"] = root._buffers
        d["_non_persistent_buffers_set"] = root._non_persistent_buffers_set
        d["training"] = root.training
        d["_selectors"] = selectors
        d["_options"] = options
        d["_model_name"] = type(model).__name__
        d["_programs"] = {}
        d["_root_hooked"] = user_hooks(root)
        d["_changes"] = [0]  # counts changes of the copied tree's submodule dicts
        d["_structure"] = -1  # the count the programs were built at
        rec = Recording(detach=options.detach, both=options.capture == "both",
                        keep=options.keep, to=options.to)
        pipeline = Pipeline(options, rec, self._site)
        rec.finalize = pipeline.finalize
        d["_rec"] = rec
        d["_pipeline"] = pipeline
        d["_hookset"] = HookSet(pipeline, capture=options.capture, copy=options.copy)
        d["_removed"] = False
        # Hooks put on the model's own modules after tap() would never run here: say so
        # (on the modules the copy shares, they run).
        shared = {id(m) for m in root.modules()}
        d["_model_hooks"] = HookWatch({p: m for p, m in model.named_modules(
            remove_duplicate=False) if id(m) not in shared})
        d["_sink"] = options.sink  # fxprobe.Disk: write(values, inputs) after each forward
        # Callers read the model's signature to decide what to pass (transformers' generate()
        # builds position_ids from the attention mask only where forward accepts them).
        d["forward"] = _signed(self._forward_of_instance(), own_forward(root))
        self._program(strict=True)
        if options.sink is not None:
            options.sink.attach(self)

    # -- building ---------------------------------------------------------------------------
    def _program(self, strict: bool = False) -> Program:
        prog = self._programs.get(self.training)
        if prog is None:
            if self._removed:
                raise RemovedError(
                    "this tapped module was removed; call fxprobe.tap(model, ...) again"
                )
            drop_overrides(self._root)
            prog = build_program(self._root, self._selectors, self._options, self.training,
                                 self._pipeline, model_name=self._model_name, strict=strict)
            self._programs[self.training] = prog
            self._install(prog)
            count_changes(self._root, self._changes, tuple(prog.dynamo))
            self.__dict__["_modules"] = self._root._modules  # maybe a counting dict now
            self.__dict__["_structure"] = self._changes[0]
        return prog

    def _site(self, name: str) -> Site | None:
        prog = self._programs.get(self.training)
        return prog.site(name) if prog is not None else None

    def _install(self, prog: Program) -> None:
        root = self._root
        for spec in prog.hooks:
            if not prog.active(spec.path):
                continue  # inside a module dynamo runs: installed if dynamo fails on it
            module = root.get_submodule(spec.path) if spec.path else root
            self._hookset.ensure(spec.name, module, spec.region)
        paths = {path for p in self._programs.values() for path in (*p.compiled, *p.dynamo)
                 if path and p.active(path)}
        for path in paths:
            module = root.get_submodule(path)
            install_override(module, self._dispatcher(module, path))
        if self._root_hooked or any("" in p.dynamo for p in self._programs.values()):
            # The root's own hooks run around the program (fxprobe calls the root); and
            # model.generate() and other methods call the model itself: one frame per call.
            install_override(root, self._root_dispatcher())

    def _dispatcher(self, module: nn.Module, path: str) -> Callable[..., Any]:
        programs, rec, store = self._programs, self._rec, self._pipeline.store
        own = own_forward(module)

        def forward(*args: Any, **kwargs: Any) -> Any:
            prog = programs.get(module.training)
            comp = prog.compiled.get(path) if prog is not None else None
            if prog is None or comp is None:
                dyn = prog.dynamo.get(path) if prog is not None else None
                if prog is not None and dyn is not None:
                    if path in prog.deferred:
                        return self._run_deferred(prog, path, dyn, own, args, kwargs)
                    return dyn(*args, **kwargs)
                return own(*args, **kwargs)
            state = rec.state
            running = state.running
            running[path] = running.get(path, 0) + 1
            try:
                result = comp.fn(comp.holder, *args, **kwargs)
            finally:
                running[path] -= 1
            store(comp.names, result[1])
            if state.active:
                calls = state.frame.hook_calls
                for name in prog.guarded.get(path, ()):
                    calls[name] = calls.get(name, 0) + 1
            return result[0]

        return _signed(forward, own)

    def _root_dispatcher(self) -> Callable[..., Any]:
        rec = self._rec

        def forward(*args: Any, **kwargs: Any) -> Any:
            if rec.state.active:  # called by fxprobe (the root's hooks ran) or by the model
                prog = self._programs.get(self._root.training) or self._program()
                return self._body(prog, args, kwargs)
            return self._run(args, kwargs, through_root=False)  # generate(): a new frame

        return _signed(forward, own_forward(self._root))

    def _run_deferred(self, prog: Program, path: str, region: DynamoRegion,
                      own: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> Any:
        """``tracer="auto"``: run a module fx could not trace under dynamo; if dynamo fails on
        it, run it as written with its hook fallback instead, and say why in ``fallbacks``."""
        state = prog.state[path]
        if state == "fallback":
            return own(*args, **kwargs)
        if state == "pending":
            self._set_state(prog, path, "dynamo")
        versions = region.versions()
        frame = self._rec.frame
        stored = len(frame.parts)
        try:
            return region(*args, **kwargs)
        except Exception as e:
            if not dynamo_failed(e):
                if state == "pending":  # the model's own error: dynamo may still work
                    self._set_state(prog, path, "pending")
                raise
            if region.versions() != versions:
                raise CaptureError(
                    f"torch dynamo failed on {region.what} "
                    f"({one_line(getattr(e, 'inner_exception', None) or e)}) after the "
                    "forward had written the module's parameters or buffers in place, so it "
                    "cannot be run again as written without writing them twice. Use "
                    "tracer='hooks' for this model, or tracer='fx+dynamo' to see dynamo's "
                    "error."
                ) from e
            # dynamo's own one-line summary of a backend failure names no cause
            reason = one_line(getattr(e, "inner_exception", None) or e)
        # Nothing the failed attempt kept stays: the module runs again, as written.
        del frame.parts[stored:]
        frame._cache = None
        self._set_state(prog, path, "fallback", reason)
        try:
            return own(*args, **kwargs)
        except Exception:
            if state == "pending":  # fails as written too: not dynamo's failure
                self._set_state(prog, path, "pending")
            raise

    def _set_state(self, prog: Program, path: str, state: str, reason: str = "") -> None:
        """Move a deferred module to ``state``: its hooks and inner regions are installed
        exactly while it runs as written."""
        prog.set_state(path, state, reason)
        if state != "fallback":
            self._hookset.discard(prog.deferred[path].sites)
            drop_overrides(self._root)
        for p in self._programs.values():
            self._install(p)
        rec = self._rec.state
        if rec.active:
            rec.hook_paths = prog.hook_names

    # -- running ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(args, kwargs, through_root=self._root_hooked)

    def _forward_of_instance(self) -> Callable[..., Any]:
        """The instance's ``forward`` (a function, to carry the model's signature)."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._run(args, kwargs, through_root=self._root_hooked)

        return forward

    def __getattr__(self, name: str) -> Any:
        # What is not the tapped module's own is the model's (config, generation_config,
        # main_input_name, transformers' _supports_* flags, methods): callers that inspect
        # the model find the same on the tapped module.
        try:
            return super().__getattr__(name)
        except AttributeError:
            root = self.__dict__.get("_root")
            if root is None:
                raise
        return getattr(root, name)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any], through_root: bool) -> Any:
        if self._removed:
            raise RemovedError("this tapped module was removed; call fxprobe.tap(model) again")
        prog = self._programs.get(self.training)
        if prog is not None:
            if self._changes[0] != self._structure:
                prog = self._retrace(self._adopt())
            elif prog.watch is not None:
                changed = prog.watch.changed()
                if changed:  # hooks on modules a graph inlined
                    prog = self._retrace(
                        f"fxprobe: hooks were registered on {_some(changed)} after tap(), "
                        "inside code fxprobe had traced through (where they would never run); "
                        "the model is traced again, so that they run. Register hooks before "
                        "tap() to avoid the second trace.")
        else:
            prog = self._program()
        late = self._model_hooks.changed()
        if late:
            warnings.warn(
                f"fxprobe: hooks were registered on the model's {_some(late)} after tap(); "
                "the tapped module runs its own copy of the module tree, where they do not "
                "run. Register them on the tapped module (tapped.get_submodule(path)), or "
                "call fxprobe.tap() again after registering them.", stacklevel=4)
        # The recording through the pipeline, as Pipeline.store reaches it: one path to it,
        # so that torch.compile adds no Python guard that the two paths agree.
        state = self._pipeline.rec.begin(prog.hook_names)
        try:
            if through_root:  # the root's own hooks run around the body (its override)
                out = self._root(*args, **kwargs)
            else:
                out = self._body(prog, args, kwargs)
        finally:
            # Also when the forward raised: the statistics of what it captured are taken now,
            # not when first read (by then a value could have changed).
            if state.frame.deferred:
                self._pipeline.finish(state.frame)
            state.active = False
        if self._sink is not None:
            self._sink.write(self._rec.values(state.frame), (args, kwargs))
        if prog.unchecked:
            check_found(prog, self._model_name)
        return out

    def _body(self, prog: Program, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        root = prog.compiled.get("")
        if root is not None:
            result = root.fn(root.holder, *args, **kwargs)
            self._pipeline.store(root.names, result[1])
            return result[0]
        dyn = prog.dynamo.get("")
        if dyn is not None:
            if "" in prog.deferred:
                return self._run_deferred(prog, "", dyn, own_forward(self._root), args, kwargs)
            return dyn(*args, **kwargs)
        return own_forward(self._root)(*args, **kwargs)

    def _adopt(self) -> str:
        """Submodules of the tapped module were replaced, added or deleted, so the graphs call
        modules that are gone: copy what was put in (fxprobe never installs on the user's
        objects) and say so."""
        adopted = adopt(self._root)
        return (
            "fxprobe: submodules of the tapped module changed after tap()"
            + (f" ({_some(adopted)} assigned; each is replaced by a copy sharing its "
               "parameters, so that fxprobe never installs anything on your object)"
               if adopted else "")
            + "; the model is traced again.")

    def _retrace(self, why: str) -> Program:
        """What the graphs were traced from changed: say ``why``, plan and compile again."""
        warnings.warn(why, stacklevel=6)
        self._programs.clear()
        return self._program()

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own ``generate`` (HuggingFace), tapped: one frame per forward it makes.

        Example:
            >>> tapped = fxprobe.tap(model, ops=F.softmax, tracer="dynamo", keep="all")
            >>> tokens = tapped.generate(input_ids, max_new_tokens=5)
            >>> len(tapped.history)  # the prompt, then one forward per new token
        """
        gen = getattr(type(self._root), "generate", None)
        if gen is None:
            raise AttributeError(f"{self._model_name} has no generate() method")
        self._program()
        return gen(self._root, *args, **kwargs)

    def intervene(self, fns: Mapping[Any, Callable[[Site, Any], Any]]) -> Intervention:
        """A block whose calls (this thread's) apply ``fn(site, value)`` at the sites each
        selector picks, as ``fn=`` does; no new capture (see docs/transformers.md).

        Example:
            >>> with tapped.intervene({"transformer.h.1.add_1": lambda s, v: v * 0}):
            ...     out = tapped(input_ids=ids)
        """
        return Intervention(self, fns)

    def run_with_cache(self, *args: Any, names: Any = None, **kwargs: Any) -> tuple[Any, Cache]:
        """``(output, cache)``: one forward and the values of the sites ``names`` selects
        (every site by default), by name. Example: ``out, cache = tapped.run_with_cache(ids)``.
        """
        return run_with_cache(self, args, kwargs, names)

    def train(self, mode: bool = True) -> TappedModule:
        super().train(mode)
        self._root.training = mode
        return self

    # -- reading ----------------------------------------------------------------------------
    @property
    def taps(self) -> Taps:
        """The values the last forward captured, by site name."""
        return Taps(self._rec, self._program().order)

    @property
    def options(self) -> TapOptions:
        """The validated options this module was tapped with."""
        return self._options

    @property
    def history(self) -> list[Taps]:
        """The kept forwards (``keep=``), oldest first; the last one is ``taps``."""
        order = self._program().order
        return [Taps(self._rec, order, frame) for frame in self._rec.history()]

    @property
    def grads(self) -> Grads:
        """With ``grad=True``: the gradient of the last backward with respect to each value."""
        if not self._options.grad:
            raise ConfigError("tapped.grads needs fxprobe.tap(..., grad=True)")
        return Grads(self._rec, self._program().order)

    @property
    def sites(self) -> tuple[Site, ...]:
        """The selected sites (current mode), in execution order.

        With ``fn=``, ``tapped.taps.replaced`` names the sites whose value ``fn`` replaced in
        the last forward.
        """
        return self._program().selected

    @property
    def captures(self) -> tuple[CaptureInfo, ...]:
        """For each module run under torch dynamo: graphs captured, graph breaks, sites found.

        Example:
            >>> out = tapped(input_ids=ids); print(*tapped.captures)
            <model>: 1 graph(s) captured by dynamo, 0 graph break(s) in the last forward, ...
        """
        return captures_of(self._program())

    @property
    def fallbacks(self) -> tuple[Fallback, ...]:
        """Modules that could not be traced and run as written (current mode), with why.

        Under ``tracer="auto"``, a module that torch dynamo captured at the first forward is
        no longer listed; one that dynamo failed on says dynamo's reason too.
        """
        return self._program().fallbacks

    @property
    def graphs(self) -> dict[str, fx.Graph]:
        """The instrumented fx graph of each traced region with a tap, by module path; then,
        once a forward captured them, each instrumented graph of torch dynamo, keyed
        ``"dynamo:<module path dynamo runs>:<n>"`` (the n-th graph dynamo captured there,
        from 0: one per graph break and recompilation), with ``"@<module path>"`` appended
        for a graph that dynamo reuses for another instance of its module.

        Example:
            >>> list(tapped.graphs)  # GPT-2, tracer="dynamo", after a forward
            ['dynamo::0']
        """
        prog = self._program()
        out = {path: c.graph for path, c in prog.compiled.items()}
        for key, version in self._dynamo_graphs(prog).items():
            out[key] = version.graph
        return out

    @staticmethod
    def _dynamo_graphs(prog: Program) -> dict[str, Any]:
        return {key: version for path, region in prog.dynamo.items()
                if prog.state.get(path) != "fallback"
                for key, version in region.instrumented().items()}

    @property
    def copied(self) -> frozenset[str]:
        """The traced sites whose value is copied before a later in-place op overwrites it
        (in dynamo's graphs too, once a forward captured them)."""
        prog = self._program()
        return frozenset([n for c in prog.compiled.values() for n in c.copied]
                         + [n for v in self._dynamo_graphs(prog).values() for n in v.copied])

    @property
    def outplaced(self) -> frozenset[str]:
        """The traced sites kept safe by running the one in-place op that would overwrite
        their value out of place (``ReLU(inplace=True)`` as ``relu``), instead of a copy (in
        dynamo's graphs too, once a forward captured them)."""
        prog = self._program()
        return frozenset([n for c in prog.compiled.values() for n in c.outplaced]
                         + [n for v in self._dynamo_graphs(prog).values() for n in v.outplaced])

    def view(self) -> View:
        """What the tables and pictures read: the plan as it stands, the selected sites, the
        last forward's values, what torch dynamo captured (``fxprobe.core.view.View``)."""
        prog = self._program()
        p = prog.current_plan()
        mode = "train" if self.training else "eval"
        return View(f"{self._model_name} ({mode} mode)", tuple(p.sites), prog.selected,
                    tuple(p.fallbacks), tapped=True,
                    taps=self.taps if self._rec.frame.parts else None,
                    capture=self._options.capture, plan=p, root=self._root,
                    captures=captures_of(prog), graphs=graphs_of(prog),
                    shapes=partial(propagate, p, self._root))

    def render(self, path: str | Path, **kw: Any) -> Path:
        """Draw the tapped graph to ``path`` (.svg, .png, .pdf or .dot); return its ``Path``.

        Keywords go to :func:`fxprobe.to_dot` (``example_input``, ``depth``, ``rankdir``).

        Example:
            >>> tapped.render("model.svg", example_input=x, depth=2)
        """
        from .pictures import render_module

        return render_module(self, path, kw)

    def summary(self, fmt: str = "text") -> Table:
        """A :class:`fxprobe.Table` of the selected sites and what the last forward captured.

        ``fmt`` is ``"text"``, ``"github"`` (Markdown) or ``"html"``. Example:
            >>> print(tapped.summary())
        """
        from ..present.summary import summary

        return summary(self.view(), fmt)

    def remove(self) -> None:
        """Remove every hook and override fxprobe installed; the last values stay readable."""
        self._hookset.remove()
        drop_overrides(self._root)
        self.__dict__["_removed"] = True
        if self._sink is not None:
            self._sink.close()  # flushes what is queued; raises if the writer failed

    def __enter__(self) -> TappedModule:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __deepcopy__(self, memo: dict[int, Any]) -> TappedModule:
        """A tapped copy of a deep copy of the model, with its own taps and no shared state."""
        root = copy.deepcopy(self._root, memo)
        drop_overrides(root)
        ours = {h.id for handles in self._hookset.handles.values() for h in handles}
        for m in root.modules():
            for key, table in vars(m).items():
                if "hooks" in key and isinstance(table, dict):
                    for hook_id in ours:
                        table.pop(hook_id, None)
        root.train(self.training)
        return TappedModule(root, self._selectors, self._options)

    def extra_repr(self) -> str:
        prog = self._programs.get(self.training)
        if prog is None or self._removed:
            return "removed" if self._removed else ""
        hooks = sum(1 for s in prog.selected if s.how == "hook")
        dyn = sum(1 for s in prog.selected if s.how == "dynamo")
        text = f"sites={len(prog.selected)} (fx={len(prog.selected) - hooks - dyn}, hook={hooks}"
        return text + (f", dynamo={dyn} found so far)" if prog.dynamo else ")")


def _signed(forward: Callable[..., Any], like: Callable[..., Any]) -> Callable[..., Any]:
    """``forward``, showing ``like``'s signature to ``inspect.signature`` (it still takes any
    arguments: the model's forward checks them)."""
    try:
        signature = inspect.signature(like)
    except (TypeError, ValueError):  # a builtin or a callable without one: nothing to show
        return forward
    forward.__signature__ = signature  # type: ignore[attr-defined]
    return forward


def _some(paths: Sequence[str]) -> str:
    """The first few of ``paths``, quoted, for a message."""
    return ", ".join(repr(p) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
