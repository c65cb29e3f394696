"""``TappedModule``, what ``fxprobe.tap`` returns for a model (``fxprobe.api``): a thin
``nn.Module`` over one record, :class:`~runtime.state.TapState`. Its programs are built per mode
(train/eval) on first use and run by ``runtime.run`` (planned by ``runtime.program``); what
running a program changes is its ``Lifecycle`` (``runtime.lifecycle``); here the record is only
read (taps, history, sites, the view) and the per-call blocks handed to ``runtime.intervene``."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import fx, nn

from ..core.errors import ConfigError
from ..core.names import renamed_property
from ..core.options import TapOptions
from ..core.record import Grads, Taps
from ..core.select import Selector, as_selector
from ..core.site import Site
from ..core.view import DynamoInfo, Fallback, Viewable
from ..frontends.mirror import drop_overrides, own_forward
from ..frontends.wrappers import site_devices
from .build import make_state
from .dispatch import signed
from .intervene import Cache, Intervention, run_with_cache
from .lifecycle import Lifecycle
from .program import Program, SiteNames, View
from .run import lifecycle, run
from .shapes import propagate
from .state import TapState

if TYPE_CHECKING:
    from ..present.summary import Table


class TappedModule(nn.Module, Viewable):
    """The model, rewritten so that the selected sites are captured at every forward.

    It shares parameters and buffers with the model (training it trains the model; converting
    it with ``.double()``, ``.to(device)`` converts the model, and the other way round) and
    leaves the model object itself untouched. ``tapped.taps`` holds the last forward's values
    of the calling thread.
    """

    _state: TapState
    """Everything it holds (``runtime.state``): built and run by ``runtime.run``, read here."""

    def __init__(self, model: nn.Module, selectors: list[Selector] | None,
                 options: TapOptions) -> None:
        super().__init__()
        state = make_state(model, selectors, options)
        root = state.root
        d = self.__dict__
        d["_state"] = state
        # The copied root's containers: state_dict keys and parameters are the model's.
        d["_modules"] = root._modules
        d["_parameters"] = root._parameters
        d["_buffers"] = root._buffers
        d["_non_persistent_buffers_set"] = root._non_persistent_buffers_set
        d["training"] = root.training
        # Callers read the model's signature to decide what to pass (transformers' generate()
        # builds position_ids from the attention mask only where forward accepts them).
        d["forward"] = signed(lambda *args, **kwargs: run(state, args, kwargs),
                              own_forward(root))
        state.shell = d
        lifecycle(state, strict=True)
        if options.sink is not None:
            options.sink.attach(self)

    def _lifecycle(self, strict: bool = False) -> Lifecycle:
        """The current mode's program as it runs (built, installed the first time)."""
        return lifecycle(self._state, strict)

    def _program(self) -> Program:
        """The current mode's program (fixed once built)."""
        return self._lifecycle().program

    @property
    def _sink(self) -> Any:
        return self._state.sink

    # -- running ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return run(self._state, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        # What is not the tapped module's own is the model's (config, generation_config,
        # main_input_name, transformers' _supports_* flags, methods): callers that inspect
        # the model find the same on the tapped module.
        try:
            return super().__getattr__(name)
        except AttributeError:
            state = self.__dict__.get("_state")
            if state is None:
                raise
        return getattr(state.root, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own ``generate`` (HuggingFace), tapped: one frame per forward it makes.

        Example:
            >>> tapped = fxprobe.tap(model, ops=F.softmax, tracer="dynamo", keep="all")
            >>> tokens = tapped.generate(input_ids, max_new_tokens=5)
            >>> len(tapped.history)  # the prompt, then one forward per new token
        """
        gen = getattr(type(self._state.root), "generate", None)
        if gen is None:
            raise AttributeError(f"{self._state.model_name} has no generate() method")
        self._lifecycle()
        return gen(self._state.root, *args, **kwargs)

    def intervene(self, fns: Mapping[Any, Callable[[Site, Any], Any]]) -> Intervention:
        """A block whose calls (this thread's) apply ``fn(site, value)`` at the sites each
        selector picks, as ``fn=`` does; no new capture (see docs/transformers.md).

        Example:
            >>> with tapped.intervene({"transformer.h.1.add_1": lambda s, v: v * 0}):
            ...     out = tapped(input_ids=ids)
        """
        if isinstance(fns, Mapping):  # the model's modules as selectors, by their paths
            fns = {self._selector(k): fn for k, fn in fns.items()}
        return Intervention(self._state, fns)

    def run_with_cache(self, *args: Any, names: Any = None, **kwargs: Any) -> tuple[Any, Cache]:
        """``(output, cache)``: one forward and the values of the sites ``names`` selects
        (every site by default), by name. Example: ``out, cache = tapped.run_with_cache(ids)``."""
        return run_with_cache(self._state, self, args, kwargs, self._selector(names))

    def _selector(self, obj: Any) -> Any:
        """``obj``; a module of the model or of the tapped module: the selector of its calls
        (its paths in the tapped tree); a collection: each of its items so."""
        if isinstance(obj, (list, tuple, set, frozenset)):
            return [self._selector(o) for o in obj]

        def paths(module: nn.Module) -> list[str]:
            pairs = self._state.model_hooks.pairs
            ids = {id(c) for _, m, c in pairs if m is module} or {id(module)}
            return [p for p, m in self._state.root.named_modules(remove_duplicate=False)
                    if id(m) in ids]

        return as_selector(obj, paths) if isinstance(obj, nn.Module) else obj

    def train(self, mode: bool = True) -> TappedModule:
        super().train(mode)
        self._state.root.training = mode
        return self

    # -- reading ----------------------------------------------------------------------------
    @property
    def taps(self) -> Taps:
        """The values the last forward captured, by site name."""
        life = self._lifecycle()
        return Taps(self._state.pipeline.rec, life.order, aliases=life.aliases)

    @property
    def options(self) -> TapOptions:
        """The validated options this module was tapped with."""
        return self._state.options

    @property
    def history(self) -> list[Taps]:
        """The kept forwards (``keep=``), oldest first; the last one is ``taps``."""
        life, rec = self._lifecycle(), self._state.pipeline.rec
        return [Taps(rec, life.order, frame, life.aliases) for frame in rec.history()]

    @property
    def grads(self) -> Grads:
        """With ``grad=True``: the gradient of the last backward with respect to each value."""
        if not self._state.options.grad:
            raise ConfigError("tapped.grads needs fxprobe.tap(..., grad=True)")
        life = self._lifecycle()
        return Grads(self._state.pipeline.rec, life.order, aliases=life.aliases)

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
        return site_devices(self.sites, self._state.root)

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
        return View(f"{self._state.model_name} ({mode} mode)", tuple(p.sites), life.selected,
                    tuple(p.fallbacks), tapped=True,
                    taps=self.taps if self._state.pipeline.rec.frame.parts else None,
                    capture=self._state.options.capture, plan=p, root=self._state.root,
                    dynamo_info=life.dynamo_info(), graphs=life.graphs(),
                    shapes=partial(propagate, p, self._state.root))

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
        self._state.hookset.remove()
        drop_overrides(self._state.root)
        self._state.removed = True
        if self._state.sink is not None:
            self._state.sink.close()  # flushes what is queued; raises if the writer failed

    def __enter__(self) -> TappedModule:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __deepcopy__(self, memo: dict[int, Any]) -> TappedModule:
        """A tapped copy of a deep copy of the model, with its own taps and no shared state."""
        root = copy.deepcopy(self._state.root, memo)
        drop_overrides(root)
        ours = {h.id for handles in self._state.hookset.handles.values() for h in handles}
        for m in root.modules():
            for key, table in vars(m).items():
                if "hooks" in key and isinstance(table, dict):
                    for hook_id in ours:
                        table.pop(hook_id, None)
        root.train(self.training)
        return TappedModule(root, self._state.selectors, self._state.options)

    def extra_repr(self) -> str:
        life = self._state.lives.get(self.training)
        if life is None or self._state.removed:
            return "removed" if self._state.removed else ""
        selected = life.selected
        hooks = sum(1 for s in selected if s.how == "hook")
        dyn = sum(1 for s in selected if s.how == "dynamo")
        text = f"sites={len(selected)} (fx={len(selected) - hooks - dyn}, hook={hooks}"
        return text + (f", dynamo={dyn} found so far)" if life.program.dynamo else ")")
