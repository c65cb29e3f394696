"""The runtime: ``TappedModule``, what ``fxprobe.tap`` returns for a model (``fxprobe.api``);
its programs are built per mode (train/eval) on first use (``runtime.program``), installed, run
and read here; what running a program changes is its ``Lifecycle`` (``runtime.lifecycle``)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

from ..capture.pipeline import Pipeline
from ..core.errors import ConfigError, RemovedError, SelectorError
from ..core.names import renamed_property, some
from ..core.options import TapOptions
from ..core.record import Grads, Recording, Taps
from ..core.select import Selector, as_selector
from ..core.site import Site
from ..core.view import DynamoInfo, Fallback, Viewable
from ..frontends.hooks import HookSet
from ..frontends.mirror import (
    HookMirror,
    adopt,
    count_changes,
    drop_overrides,
    install_override,
    mirror,
    own_forward,
    user_hooks,
)
from ..frontends.wrappers import site_devices
from .dispatch import module_dispatcher, root_dispatcher, signed
from .intervene import Cache, Intervention, run_with_cache
from .lifecycle import Lifecycle, State, fall_back_all
from .program import Program, SiteNames, View, build_program
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
    _lives: dict[bool, Lifecycle]
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
        d["_lives"] = {}  # per mode: its program, as it runs
        d["_root_hooked"] = user_hooks(root)
        d["_changes"] = [0]  # counts changes of the copied tree's submodule dicts
        d["_structure"] = -1  # the count the programs were built at
        rec = Recording(options)
        pipeline = Pipeline(options, rec, self._site)
        rec.finalize = pipeline.finalize
        d["_rec"] = rec
        d["_pipeline"] = pipeline
        d["_hookset"] = HookSet(pipeline, capture=options.capture, copy=options.copy)
        d["_removed"] = False
        # The copy has hook tables of its own: the model's hooks as the user sets them after
        # tap() (registered or removed) are carried over at each forward.
        shared = {id(m) for m in root.modules()}
        copies = dict(root.named_modules(remove_duplicate=False))
        pairs = {id(m): (p, m, copies[p]) for p, m in model.named_modules(
            remove_duplicate=False) if id(m) not in shared and p in copies}
        d["_model_hooks"] = HookMirror(list(pairs.values()))
        d["_sink"] = options.sink  # fxprobe.Disk: write(values, inputs) after each forward
        # Callers read the model's signature to decide what to pass (transformers' generate()
        # builds position_ids from the attention mask only where forward accepts them).
        d["forward"] = signed(self._forward_of_instance(), own_forward(root))
        self._lifecycle(strict=True)
        if options.sink is not None:
            options.sink.attach(self)

    # -- building ---------------------------------------------------------------------------
    def _lifecycle(self, strict: bool = False) -> Lifecycle:
        """The current mode's program as it runs (built, installed the first time)."""
        life = self._lives.get(self.training)
        if life is None:
            if self._removed:
                raise RemovedError(
                    "this tapped module was removed; call fxprobe.tap(model, ...) again"
                )
            drop_overrides(self._root)
            prog = build_program(self._root, self._selectors, self._options, self.training,
                                 self._pipeline, model_name=self._model_name, strict=strict)
            life = Lifecycle(prog, self._rec, self._moved)
            self._lives[self.training] = life
            self._install(life)
            count_changes(self._root, self._changes, tuple(prog.dynamo))
            self.__dict__["_modules"] = self._root._modules  # maybe a counting dict now
            self.__dict__["_structure"] = self._changes[0]
        return life

    def _program(self, strict: bool = False) -> Program:
        """The current mode's program (fixed once built)."""
        return self._lifecycle(strict).program

    def _site(self, name: str) -> Site | None:
        life = self._lives.get(self.training)
        return life.site(name) if life is not None else None

    def _install(self, life: Lifecycle) -> None:
        root = self._root
        for spec in life.program.hooks:
            if not life.active(spec.path):
                continue  # inside a module dynamo runs: installed if dynamo fails on it
            module = root.get_submodule(spec.path) if spec.path else root
            self._hookset.ensure(spec.name, module, spec.region)
        paths = {path for li in self._lives.values()
                 for path in (*li.program.compiled, *li.program.dynamo)
                 if path and li.active(path)}
        for path in paths:
            module = root.get_submodule(path)
            install_override(module, self._dispatcher(module, path))
        if self._root_hooked or any("" in li.program.dynamo for li in self._lives.values()):
            # The root's own hooks run around the program (fxprobe calls the root); and
            # model.generate() and other methods call the model itself: one frame per call.
            install_override(root, self._root_dispatcher())

    def _dispatcher(self, module: nn.Module, path: str) -> Callable[..., Any]:
        return module_dispatcher(self._lives, self._rec, self._pipeline.store, module, path)

    def _root_dispatcher(self) -> Callable[..., Any]:
        return root_dispatcher(self)

    def _moved(self, life: Lifecycle, path: str, state: State) -> None:
        """A deferred module moved to ``state``: its hooks and inner regions are installed
        exactly while it runs as written."""
        if state is not State.FALLBACK:
            self._hookset.discard(life.program.deferred[path].sites)
            drop_overrides(self._root)
        for other in self._lives.values():
            self._install(other)

    # -- running ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(args, kwargs)

    def _forward_of_instance(self) -> Callable[..., Any]:
        """The instance's ``forward`` (a function, to carry the model's signature)."""
        return lambda *args, **kwargs: self._run(args, kwargs)

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

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any],
             through_root: bool | None = None) -> Any:
        if self._removed:
            raise RemovedError("this tapped module was removed; call fxprobe.tap(model) again")
        if "" in self._model_hooks.sync():  # the model's hooks as set now: the root's changed
            self.__dict__["_root_hooked"] = user_hooks(self._root)  # fxprobe calls the root
            for other in self._lives.values():  # exactly while it has hooks
                self._install(other)
        if through_root is None:  # a call of the tapped module: the root's hooks run around
            through_root = self._root_hooked
        life = self._lives.get(self.training)
        if life is not None:
            watch = life.program.watch
            if self._changes[0] != self._structure:
                life = self._retrace(self._adopt())
            elif watch is not None:
                changed = watch.changed()
                if changed:  # hooks on modules a graph inlined
                    users = watch.by_user(changed)  # not a library's own (transformers')
                    life = self._retrace(
                        f"fxprobe: the hooks of {some(users)} changed after tap() (on the "
                        "model or the tapped module), inside code fxprobe had traced through "
                        "(where they would not run as set); the model is traced again, so that "
                        "they do. Register hooks before tap() to avoid the second trace."
                        if users else None)
        else:
            life = self._lifecycle()
        if life.waiting and torch.compiler.is_compiling():  # a deferred module: as written
            fall_back_all(life)
        # The recording through the pipeline, as Pipeline.store reaches it: one path to it,
        # so that torch.compile adds no Python guard that the two paths agree.
        state = self._pipeline.rec.begin(life.hook_names)
        try:
            if through_root:  # the root's own hooks run around the body (its override)
                out = self._root(*args, **kwargs)
            else:
                out = self._body(life, args, kwargs)
        finally:
            # Also when the forward raised: the statistics of what it captured are taken now,
            # not when first read (by then a value could have changed).
            if state.frame.deferred:
                self._pipeline.finish(state.frame)
            state.active = False
        if life.unchecked:  # before anything is written: a failed selection writes nothing
            try:
                life.check(self._model_name)
            except SelectorError:
                if self._sink is not None:  # and holds nothing (a corrected tap writes there)
                    self._sink.release()
                raise
        if self._sink is not None:
            self._sink.write(self._rec.values(state.frame), (args, kwargs))
        return out

    def _body(self, life: Lifecycle, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        prog = life.program
        root = prog.compiled.get("")
        if root is not None:
            result = root.fn(root.holder, *args, **kwargs)
            self._pipeline.store(root.names, result[1])
            return result[0]
        dyn = prog.dynamo.get("")
        if dyn is not None:
            if "" in prog.deferred:  # tracer="auto": the lifecycle decides what runs
                return life.run("", own_forward(self._root), args, kwargs)
            return dyn(*args, **kwargs)
        return own_forward(self._root)(*args, **kwargs)

    def _adopt(self) -> str:
        """Submodules of the tapped module were replaced, added or deleted, so the graphs call
        modules that are gone: copy what was put in (fxprobe never installs on the user's
        objects) and say so."""
        adopted = adopt(self._root)
        return (
            "fxprobe: submodules of the tapped module changed after tap()"
            + (f" ({some(adopted)} assigned; each is replaced by a copy sharing its "
               "parameters, so that fxprobe never installs anything on your object)"
               if adopted else "")
            + "; the model is traced again.")

    def _retrace(self, why: str | None) -> Lifecycle:
        """What the graphs were traced from changed: say ``why`` (unless None: a library's own
        hooks), plan and compile again."""
        if why is not None:
            warnings.warn(why, stacklevel=6)
        self._lives.clear()
        return self._lifecycle()

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
        self._lifecycle()
        return gen(self._root, *args, **kwargs)

    def intervene(self, fns: Mapping[Any, Callable[[Site, Any], Any]]) -> Intervention:
        """A block whose calls (this thread's) apply ``fn(site, value)`` at the sites each
        selector picks, as ``fn=`` does; no new capture (see docs/transformers.md).

        Example:
            >>> with tapped.intervene({"transformer.h.1.add_1": lambda s, v: v * 0}):
            ...     out = tapped(input_ids=ids)
        """
        if isinstance(fns, Mapping):  # the model's modules as selectors, by their paths
            fns = {self._selector(k): fn for k, fn in fns.items()}
        return Intervention(self, fns)

    def run_with_cache(self, *args: Any, names: Any = None, **kwargs: Any) -> tuple[Any, Cache]:
        """``(output, cache)``: one forward and the values of the sites ``names`` selects
        (every site by default), by name. Example: ``out, cache = tapped.run_with_cache(ids)``."""
        return run_with_cache(self, args, kwargs, self._selector(names))

    def _selector(self, obj: Any) -> Any:
        """``obj``; a module of the model or of the tapped module: the selector of its calls
        (its paths in the tapped tree); a collection: each of its items so."""
        if isinstance(obj, (list, tuple, set, frozenset)):
            return [self._selector(o) for o in obj]

        def paths(module: nn.Module) -> list[str]:
            ids = {id(c) for _, m, c in self._model_hooks.pairs if m is module} or {id(module)}
            return [p for p, m in self._root.named_modules(remove_duplicate=False)
                    if id(m) in ids]

        return as_selector(obj, paths) if isinstance(obj, nn.Module) else obj

    def train(self, mode: bool = True) -> TappedModule:
        super().train(mode)
        self._root.training = mode
        return self

    # -- reading ----------------------------------------------------------------------------
    @property
    def taps(self) -> Taps:
        """The values the last forward captured, by site name."""
        life = self._lifecycle()
        return Taps(self._rec, life.order, aliases=life.aliases)

    @property
    def options(self) -> TapOptions:
        """The validated options this module was tapped with."""
        return self._options

    @property
    def history(self) -> list[Taps]:
        """The kept forwards (``keep=``), oldest first; the last one is ``taps``."""
        life = self._lifecycle()
        return [Taps(self._rec, life.order, frame, life.aliases) for frame in self._rec.history()]

    @property
    def grads(self) -> Grads:
        """With ``grad=True``: the gradient of the last backward with respect to each value."""
        if not self._options.grad:
            raise ConfigError("tapped.grads needs fxprobe.tap(..., grad=True)")
        life = self._lifecycle()
        return Grads(self._rec, life.order, aliases=life.aliases)

    @property
    def sites(self) -> tuple[Site, ...]:
        """The selected sites (current mode), in execution order.

        With ``fn=``, ``tapped.taps.replaced`` names the sites whose value ``fn`` replaced in
        the last forward.
        """
        return self._lifecycle().selected

    @property
    def devices(self) -> dict[str, str]:
        """Where each selected site is computed, for a model accelerate dispatched; else {}."""
        return site_devices(self.sites, self._root)

    @property
    def dynamo_info(self) -> tuple[DynamoInfo, ...]:
        """For each module run under torch dynamo: graphs captured, graph breaks, sites found
        (``print(*tapped.dynamo_info)``: ``<model>: 1 graph(s) captured by dynamo, ...``)."""
        return self._lifecycle().dynamo_info()

    captures = renamed_property("tapped.captures", "dynamo_info")

    @property
    def fallbacks(self) -> tuple[Fallback, ...]:
        """Modules that could not be traced and run as written (current mode), with why.

        Under ``tracer="auto"``, a module that torch dynamo captured at the first forward is
        no longer listed; one that dynamo failed on says dynamo's reason too.
        """
        return self._lifecycle().fallbacks

    def known_sites(self) -> SiteNames:
        """Every site known now in the current mode, selected or not, as ``fxprobe.sites``
        lists them: the plan's, then those torch dynamo found so far (after a forward), with
        the modules that run as written.

        Example:
            >>> tapped = fxprobe.tap(gpt2, ops=F.softmax, tracer="dynamo")
            >>> out = tapped(input_ids=ids); tapped.known_sites()[:2]
            ('transformer.view', 'transformer.wte')
        """
        return self._lifecycle().site_names()

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
        life = self._lifecycle()
        out = {path: c.graph for path, c in life.program.compiled.items()}
        return out | {key: v.graph for key, v in life.dynamo_graphs().items()}

    @property
    def copied(self) -> frozenset[str]:
        """The traced sites whose value is copied before a later in-place op overwrites it
        (in dynamo's graphs too, once a forward captured them)."""
        return self._lifecycle().kept_safe("copied")

    @property
    def outplaced(self) -> frozenset[str]:
        """The traced sites kept safe by running the one in-place op that would overwrite
        their value out of place (``ReLU(inplace=True)`` as ``relu``), instead of a copy (in
        dynamo's graphs too, once a forward captured them)."""
        return self._lifecycle().kept_safe("outplaced")

    def view(self) -> View:
        """What the tables and pictures read: the plan as it stands, the selected sites, the
        last forward's values, what torch dynamo captured (``fxprobe.core.view.View``)."""
        life = self._lifecycle()
        p = life.current_plan()
        mode = "train" if self.training else "eval"
        return View(f"{self._model_name} ({mode} mode)", tuple(p.sites), life.selected,
                    tuple(p.fallbacks), tapped=True,
                    taps=self.taps if self._rec.frame.parts else None,
                    capture=self._options.capture, plan=p, root=self._root,
                    dynamo_info=life.dynamo_info(), graphs=life.graphs(),
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
        life = self._lives.get(self.training)
        if life is None or self._removed:
            return "removed" if self._removed else ""
        selected = life.selected
        hooks = sum(1 for s in selected if s.how == "hook")
        dyn = sum(1 for s in selected if s.how == "dynamo")
        text = f"sites={len(selected)} (fx={len(selected) - hooks - dyn}, hook={hooks}"
        return text + (f", dynamo={dyn} found so far)" if life.program.dynamo else ")")
