"""``fxprobe.tap``: the tapped module, built per mode (train/eval) on first use."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

from ._dynamo import CaptureInfo, DynamoRegion
from ._errors import ConfigError, RemovedError, SelectorError, UnsupportedModelError
from ._hooks import HookSet
from ._mirror import drop_overrides, mirror
from ._modes import Modes, make_modes
from ._options import Reduce, TapOptions, check_choice, make_options
from ._record import Grads, Recording, Taps
from ._rewrite import Capture, Compiled, CopyPolicy, compile_region, instrument
from ._select import Selector, as_selectors, no_match_message, select
from ._site import Site
from ._trace import Fallback, Plan, TracerKind, is_leaf, plan

if TYPE_CHECKING:
    from ._summary import Table


@dataclass
class Program:
    """Everything one mode of a tapped module runs: compiled regions and hook sites."""

    training: bool
    plan: Plan
    selected: tuple[Site, ...]
    compiled: dict[str, Compiled]
    hook_paths: frozenset[str]
    order: dict[str, int]
    dynamo: dict[str, DynamoRegion] = field(default_factory=dict)
    """Modules run under torch dynamo, by path; their sites are found as they first run."""
    dynamo_selected: list[Site] = field(default_factory=list)
    """The selected sites found in dynamo graphs so far."""
    unchecked: list[Selector] = field(default_factory=list)
    """Selectors that matched no site before the first forward (checked after it)."""


def check_model(model: Any) -> None:
    if isinstance(model, torch.jit.ScriptModule):
        raise UnsupportedModelError(
            f"{type(model).__name__} is a TorchScript module, which fxprobe does not tap yet; "
            "pass the original Python nn.Module (before torch.jit.script/trace) instead"
        )
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(
            f"fxprobe taps torch.nn.Module instances; got {type(model).__name__}. "
            "Wrap a function in an nn.Module whose forward calls it."
        )


class TappedModule(nn.Module):
    """The model, rewritten so that the selected sites are captured at every forward.

    It shares parameters and buffers with the model (training it trains the model) and leaves
    the model object itself untouched. ``tapped.taps`` holds the last forward's values.
    """

    _root: nn.Module
    _selectors: list[Selector] | None
    _options: TapOptions
    _model_name: str
    _rec: Recording
    _modes: Modes
    _hookset: HookSet
    _programs: dict[bool, Program]
    _site_by_name: dict[str, Site]
    _removed: bool

    def __init__(self, model: nn.Module, selectors: list[Selector] | None,
                 options: TapOptions) -> None:
        super().__init__()
        root = mirror(model)
        d = self.__dict__
        d["_root"] = root
        # Same containers as the copied root: state_dict keys and parameters are the model's.
        d["_modules"] = root._modules
        d["_parameters"] = root._parameters
        d["_buffers"] = root._buffers
        d["_non_persistent_buffers_set"] = root._non_persistent_buffers_set
        d["training"] = root.training
        d["_selectors"] = selectors
        d["_options"] = options
        d["_model_name"] = type(model).__name__
        d["_site_by_name"] = {}
        rec = Recording(detach=options.detach, both=options.capture == "both",
                        keep=options.keep, to=options.to)
        modes = make_modes(options, rec, self._site_by_name.get)
        rec.finalize, rec.grad_hook = modes.finalize, modes.grad_hook
        d["_rec"] = rec
        d["_modes"] = modes
        d["_hookset"] = HookSet(rec, modes, capture=options.capture, copy=options.copy)
        d["_programs"] = {}
        d["_removed"] = False
        self._program(strict=True)

    # -- building ---------------------------------------------------------------------------
    def _program(self, strict: bool = False) -> Program:
        prog = self._programs.get(self.training)
        if prog is None:
            if self._removed:
                raise RemovedError(
                    "this tapped module was removed; call fxprobe.tap(model, ...) again"
                )
            prog = self._build(self.training, strict)
        return prog

    def _build(self, training: bool, strict: bool) -> Program:
        opts = self._options
        tracer, leaf_modules, autowrap = opts.tracer, opts.leaf_modules, opts.autowrap_functions
        root = self._root
        drop_overrides(root)
        p = plan(root, tracer=tracer, leaf_modules=leaf_modules, autowrap_functions=autowrap)
        mode = "train" if training else "eval"
        context = f"{self._model_name} ({mode} mode)"
        selectors = self._selectors
        unmatched = [] if selectors is None else [
            sel for sel in selectors if not any(sel(s) for s in p.sites)]
        if unmatched and strict and not p.dynamo:
            # A selector may name a site of the other mode only (dropout in training): fail
            # only when it matches nothing in either mode.
            other = mirror(root)
            other.train(not training)
            other_sites = plan(other, tracer=tracer, leaf_modules=leaf_modules,
                               autowrap_functions=autowrap).sites
            for sel in unmatched:
                select(other_sites, [sel], context=f"{self._model_name} (train or eval mode)")
        selected = select(p.sites, None if selectors is None else [
            sel for sel in selectors if sel not in unmatched], context=context
        ) if len(unmatched) < len(selectors or [None]) else []
        names = {s.name for s in selected}
        compiled: dict[str, Compiled] = {}
        for path, region in p.regions.items():
            region_names = names & set(region.names.values())
            if not region_names:
                continue  # nothing selected here: the module runs its own forward
            graph, order, copied = instrument(
                region, region_names, capture=opts.capture, copy=opts.copy,
                reducer=self._modes.reduce, intervene=self._modes.intervene,
                raw=self._modes.grad_hook is not None)
            compiled[path] = compile_region(region, graph, order, copied)
        hook_paths = frozenset(s.name for s in selected if s.how == "hook")
        for s in selected:
            if s.how == "hook":
                self._hookset.ensure(s.name, root.get_submodule(s.name) if s.name else root)
        if opts.fn is not None:
            selected = [dataclasses.replace(s, replaced=True) for s in selected]
        self._site_by_name.update((s.name, s) for s in selected)
        prog = Program(training, p, tuple(selected), compiled, hook_paths,
                       {s.name: i for i, s in enumerate(selected)})
        if p.dynamo:
            prog.unchecked = list(unmatched)
            for target in p.dynamo:
                prog.dynamo[target.path] = self._dynamo_region(prog, target.path)
        self._programs[training] = prog
        self._install_dispatch()
        return prog

    def _dynamo_region(self, prog: Program, path: str) -> DynamoRegion:
        opts, selectors = self._options, self._selectors
        leaf_types = tuple(t for t in opts.leaf_modules if isinstance(t, type))
        leaf_paths = frozenset(p for p in opts.leaf_modules if isinstance(p, str))

        def choose(found: Sequence[Site]) -> list[Site]:
            if selectors is None:
                return list(found)
            return [s for s in found if any(sel(s) for sel in selectors)]

        def on_sites(new: list[Site], chosen: list[Site]) -> None:
            if opts.fn is not None:
                chosen = [dataclasses.replace(s, replaced=True) for s in chosen]
            for s in chosen:
                if s.name not in prog.order:
                    prog.order[s.name] = len(prog.order)
                    prog.dynamo_selected.append(s)
                    self._site_by_name[s.name] = s

        module = self._root.get_submodule(path) if path else self._root
        return DynamoRegion(
            path, module, rec=self._rec, modes=self._modes, capture=opts.capture,
            copy=opts.copy, is_leaf=lambda m, p: is_leaf(m, p, leaf_types, leaf_paths),
            choose=choose, on_sites=on_sites)

    def _check_selectors(self, prog: Program) -> None:
        """After a forward: each selector must have matched a site (dynamo sites included)."""
        found = list(prog.plan.sites) + [
            s for region in prog.dynamo.values() for s in region.sites.values()]
        missing = [sel for sel in prog.unchecked if not any(sel(s) for s in found)]
        if missing:
            mode = "train" if prog.training else "eval"
            raise SelectorError(no_match_message(
                missing[0], found, f"{self._model_name} ({mode} mode, sites found by its "
                "first forward: the dynamo frontend discovers sites as graphs are captured)"))
        prog.unchecked = []

    def _install_dispatch(self) -> None:
        paths = {path for prog in self._programs.values()
                 for path in (*prog.compiled, *prog.dynamo) if path}
        if any("" in prog.dynamo for prog in self._programs.values()):
            # model.generate() and other methods call the model itself: one frame per call.
            object.__setattr__(self._root, "forward", self._root_dispatcher())
        for path in paths:
            module = self._root.get_submodule(path)
            object.__setattr__(module, "forward", self._dispatcher(module, path))

    def _dispatcher(self, module: nn.Module, path: str) -> Callable[..., Any]:
        programs, rec = self._programs, self._rec
        own_forward = type(module).forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            prog = programs.get(module.training)
            comp = prog.compiled.get(path) if prog is not None else None
            if comp is None:
                dyn = prog.dynamo.get(path) if prog is not None else None
                if dyn is not None:
                    return dyn(*args, **kwargs)
                return own_forward(module, *args, **kwargs)
            result = comp.fn(comp.holder, *args, **kwargs)
            if rec.active:
                rec.add(comp.names, *result[1:])
            return result[0]

        return forward

    def _root_dispatcher(self) -> Callable[..., Any]:
        rec = self._rec
        own_forward = type(self._root).forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            prog = self._programs.get(self._root.training)
            dyn = prog.dynamo.get("") if prog is not None else None
            if dyn is None:
                return own_forward(self._root, *args, **kwargs)
            if rec.active:
                return dyn(*args, **kwargs)
            return self.forward(*args, **kwargs)

        return forward

    # -- running ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._removed:
            raise RemovedError("this tapped module was removed; call fxprobe.tap(model) again")
        prog = self._programs.get(self.training) or self._program()
        rec = self._rec
        rec.begin(prog.hook_paths)
        try:
            root = prog.compiled.get("")
            dyn = prog.dynamo.get("")
            if root is not None:
                result = root.fn(root.holder, *args, **kwargs)
                rec.add(root.names, *result[1:])
                out = result[0]
            elif dyn is not None:
                out = dyn(*args, **kwargs)
            else:
                out = type(self._root).forward(self._root, *args, **kwargs)
        finally:
            rec.active = False
        if prog.unchecked:
            self._check_selectors(prog)
        return out

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own ``generate`` (HuggingFace), tapped: one frame per forward it makes.

        Example:
            >>> tapped = fxprobe.tap(model, ops=F.softmax, keep="all")
            >>> tokens = tapped.generate(input_ids, max_new_tokens=5)
            >>> len(tapped.history)  # the prompt, then one forward per new token
        """
        gen = getattr(type(self._root), "generate", None)
        if gen is None:
            raise AttributeError(f"{self._model_name} has no generate() method")
        self._program()
        return gen(self._root, *args, **kwargs)

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
    def history(self) -> list[Taps]:
        """The kept forwards (``keep=``), oldest first; the last one is ``taps``."""
        order = self._program().order
        return [Taps(self._rec, order, frame) for frame in self._rec.history]

    @property
    def grads(self) -> Grads:
        """With ``grad=True``: the gradient of the last backward with respect to each value."""
        if not self._options.grad:
            raise ConfigError("tapped.grads needs fxprobe.tap(..., grad=True)")
        return Grads(self._rec, self._program().order, what="gradient")

    @property
    def sites(self) -> tuple[Site, ...]:
        """The selected sites (current mode), in execution order.

        With ``fn=``, ``site.replaced`` marks the sites whose value ``fn`` replaced in the last
        forward.
        """
        prog = self._program()
        selected = prog.selected + tuple(prog.dynamo_selected)
        if self._options.fn is None:
            return selected
        done = self._rec.frame.replaced
        return tuple(dataclasses.replace(s, replaced=s.name in done) for s in selected)

    @property
    def captures(self) -> tuple[CaptureInfo, ...]:
        """For each module run under torch dynamo: graphs captured, graph breaks, sites found.

        Example:
            >>> out = tapped(input_ids=ids); print(*tapped.captures)
            <model>: 1 graph(s) captured by dynamo, 0 graph break(s) in the last forward, ...
        """
        return tuple(region.info for region in self._program().dynamo.values())

    @property
    def fallbacks(self) -> tuple[Fallback, ...]:
        """Modules that could not be traced and run as written (current mode), with why."""
        return tuple(self._program().plan.fallbacks)

    @property
    def graphs(self) -> dict[str, fx.Graph]:
        """The instrumented fx graph of each traced region with a tap, by module path."""
        return {path: c.graph for path, c in self._program().compiled.items()}

    def render(self, path: str | Path, **kw: Any) -> Path:
        """Draw the tapped graph to ``path`` (.svg, .png, .pdf or .dot); return its ``Path``.

        Keywords go to :func:`fxprobe.to_dot` (``example_input``, ``depth``, ``rankdir``).

        Example:
            >>> tapped.render("model.svg", example_input=x, depth=2)
        """
        from ._viz import render

        return render(self, path, **kw)

    def summary(self, fmt: str = "text") -> Table:
        """A :class:`fxprobe.Table` of the selected sites and what the last forward captured.

        ``fmt`` is ``"text"``, ``"github"`` (Markdown) or ``"html"``. Example:
            >>> print(tapped.summary())
        """
        from ._summary import summary

        return summary(self, fmt)

    def remove(self) -> None:
        """Remove every hook and override fxprobe installed; the last values stay readable."""
        self._hookset.remove()
        drop_overrides(self._root)
        self.__dict__["_removed"] = True

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
        text = f"sites={len(prog.selected)} (fx={len(prog.selected) - hooks}, hook={hooks})"
        if prog.dynamo:
            text += f", dynamo={len(prog.dynamo_selected)} found so far"
        return text


def tap(model: nn.Module, ops: Any = None, *, capture: Capture = "output", detach: bool = True,
        copy: CopyPolicy = "auto", tracer: TracerKind = "auto",
        leaf_modules: Sequence[Any] = (), autowrap_functions: Sequence[Callable[..., Any]] = (),
        reduce: Reduce | Callable[[torch.Tensor], Any] | None = None, sample_size: int = 1024,
        seed: int = 0, keep: int | str = "last", to: str | torch.device | None = None,
        fn: Callable[[Site, Any], Any] | None = None, grad: bool = False,
        grad_fn: Callable[[Site, torch.Tensor], Any] | None = None) -> TappedModule:
    """Tap ``model`` at the sites ``ops`` selects; run the result like the model.

    Args:
        model: any ``nn.Module``; it is never modified.
        ops: ``None`` (every site), a selector, or a list of selectors (their union): an
            ``nn.Module`` type, a function or operator, a glob on site names, a ``re.Pattern``,
            or ``fxprobe.where(predicate)``.
        capture: ``"output"``, ``"input"`` or ``"both"``.
        detach: keep captured tensors out of the autograd graph (the default).
        copy: ``"auto"`` copies a value only when a later in-place op would overwrite it;
            ``"always"`` or ``"never"``.
        tracer: ``"auto"`` traces what it can and reaches the rest by hooks; ``"fx"`` fails
            if anything cannot be traced; ``"hooks"`` uses hooks only.
        leaf_modules: module types or qualified paths not to trace into.
        autowrap_functions: functions to record as single calls instead of tracing into.
        reduce: keep a reduction instead of each tensor: ``"stats"`` (a :class:`Stats` per
            tensor, computed on its device without a host sync), ``"sample"`` (``sample_size``
            elements drawn with ``seed``, the same positions every forward), or a function of
            a tensor returning tensors.
        keep: ``"last"`` forward (default), a number N of forwards (``tapped.history``), or
            ``"all"`` (memory grows with every forward).
        to: copy captured values to this device without blocking (``"cpu"``: pinned memory);
            reading a value waits for its own copy only.
        fn: ``fn(site, value)`` runs at each tap; returning a tensor replaces the value for
            every downstream consumer (``None`` observes).
        grad: after ``backward()``, ``tapped.grads[name]`` is the gradient with respect to
            each tapped value.
        grad_fn: ``grad_fn(site, grad)`` on each such gradient; a returned tensor replaces it.

    Returns:
        A :class:`TappedModule`.

    Raises:
        SelectorError: a selector matches no site. SelectorTypeError: a selector of unknown
        type. TraceError: ``tracer="fx"`` and part of the model cannot be traced.
        UnsupportedModelError: not an ``nn.Module``, or a TorchScript module.

    Example:
        >>> tapped = fxprobe.tap(model, ops=[nn.Conv2d, torch.flatten])
        >>> out = tapped(x); tapped.taps["flatten"].shape
    """
    check_model(model)
    options = make_options(
        capture=capture, detach=detach, copy=copy, tracer=tracer, leaf_modules=leaf_modules,
        autowrap_functions=autowrap_functions, reduce=reduce, sample_size=sample_size, seed=seed,
        keep=keep, to=to, fn=fn, grad=grad, grad_fn=grad_fn)
    return TappedModule(model, as_selectors(ops), options)


class SiteNames(tuple[str, ...]):
    """Site names in execution order; ``.records`` holds the :class:`Site` of each."""

    records: tuple[Site, ...]
    fallbacks: tuple[Fallback, ...]

    def __new__(cls, records: Sequence[Site], fallbacks: Sequence[Fallback]) -> SiteNames:
        self = super().__new__(cls, (s.name for s in records))
        self.records = tuple(records)
        self.fallbacks = tuple(fallbacks)
        return self

    def table(self, fmt: str = "text") -> Table:
        """A table of name, op, module path and how each site is reached.

        ``fmt`` is ``"text"``, ``"github"`` (Markdown) or ``"html"``.

        Example:
            >>> print(fxprobe.sites(model).table())
        """
        from ._summary import summary

        return summary(self, fmt)


def sites(model: nn.Module, *, train: bool = False, tracer: TracerKind = "auto",
          leaf_modules: Sequence[Any] = (), autowrap_functions: Sequence[Callable[..., Any]] = (),
          example_input: Any = None, example_kwargs: dict[str, Any] | None = None
          ) -> SiteNames:
    """Every tappable site name of ``model``, in execution order (eval mode unless ``train``).

    Names follow torchvision's ``get_graph_node_names``; inside modules that cannot be traced,
    module calls are listed by path in registration order. The model is not modified.

    With ``tracer="dynamo"`` or ``"fx+dynamo"``, the sites of modules that dynamo captures are
    found by running them: pass ``example_input`` (a tensor or a tuple of positional
    arguments) and/or ``example_kwargs``; they are listed after the other sites, in the order
    the forward reached them.

    Raises:
        ConfigError: dynamo captures part of the model and no example input was given.

    Example:
        >>> fxprobe.sites(model)[:3]
        ('x', 'conv1', 'bn1')
        >>> fxprobe.sites(gpt2, tracer="dynamo", example_kwargs={"input_ids": ids})[:2]
        ('transformer.view', 'transformer.wte')
    """
    check_model(model)
    check_choice("tracer", tracer, TracerKind)
    root = mirror(model)
    root.train(train)
    p = plan(root, tracer=tracer, leaf_modules=leaf_modules,
             autowrap_functions=autowrap_functions)
    if not p.dynamo:
        return SiteNames(p.sites, p.fallbacks)
    if example_input is None and example_kwargs is None:
        paths = ", ".join(repr(t.path) for t in p.dynamo)
        raise ConfigError(
            f"torch dynamo captures {paths} of {type(model).__name__}, whose sites are found by "
            "running it: pass example_input=(args...) and/or example_kwargs={...}, e.g. "
            "fxprobe.sites(model, tracer='dynamo', example_kwargs={'input_ids': ids})"
        )
    args = example_input if isinstance(example_input, tuple) else (
        () if example_input is None else (example_input,))
    nothing = Selector(lambda s: False, "nothing")
    options = make_options(
        capture="output", detach=True, copy="auto", tracer=tracer, leaf_modules=leaf_modules,
        autowrap_functions=autowrap_functions, reduce=None, sample_size=1, seed=0, keep="last",
        to=None, fn=None, grad=False, grad_fn=None)
    probe = TappedModule(root, [nothing], options)
    try:
        prog = probe._program()
        prog.unchecked = []  # discovery only: selecting nothing is the point
        with torch.no_grad():
            probe(*args, **(example_kwargs or {}))
        found = list(prog.plan.sites) + [
            s for region in prog.dynamo.values() for s in region.sites.values()]
    finally:
        probe.remove()
    return SiteNames(found, p.fallbacks)
