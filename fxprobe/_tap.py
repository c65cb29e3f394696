"""``fxprobe.tap``: the tapped module, built per mode (train/eval) on first use."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_args

import torch
from torch import fx, nn

from ._errors import ConfigError, RemovedError, UnsupportedModelError
from ._hooks import HookSet
from ._mirror import drop_overrides, mirror
from ._record import Recording, Taps
from ._rewrite import Capture, Compiled, CopyPolicy, compile_region, instrument
from ._select import Selector, as_selectors, select
from ._site import Site
from ._trace import Fallback, Plan, TracerKind, plan


@dataclass
class Program:
    """Everything one mode of a tapped module runs: compiled regions and hook sites."""

    training: bool
    plan: Plan
    selected: tuple[Site, ...]
    compiled: dict[str, Compiled]
    hook_paths: frozenset[str]
    order: dict[str, int]

    @property
    def root(self) -> Compiled | None:
        return self.compiled.get("")


def _check_choice(name: str, value: Any, allowed: Any) -> None:
    choices = get_args(allowed)
    if value not in choices:
        raise ConfigError(
            f"{name}={value!r} is not accepted; use one of {', '.join(map(repr, choices))}"
        )


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
    _options: tuple[Capture, CopyPolicy, TracerKind, tuple[Any, ...], tuple[Any, ...]]
    _model_name: str
    _rec: Recording
    _hookset: HookSet
    _programs: dict[bool, Program]
    _removed: bool

    def __init__(self, model: nn.Module, selectors: list[Selector] | None, *, capture: Capture,
                 detach: bool, copy: CopyPolicy, tracer: TracerKind,
                 leaf_modules: Sequence[Any], autowrap_functions: Sequence[Callable[..., Any]]
                 ) -> None:
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
        d["_options"] = (capture, copy, tracer, tuple(leaf_modules), tuple(autowrap_functions))
        d["_model_name"] = type(model).__name__
        d["_rec"] = Recording(detach=detach, both=capture == "both")
        d["_hookset"] = HookSet(self._rec, capture=capture, copy=copy)
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
        capture, copy, tracer, leaf_modules, autowrap = self._options
        root = self._root
        drop_overrides(root)
        p = plan(root, tracer=tracer, leaf_modules=leaf_modules, autowrap_functions=autowrap)
        mode = "train" if training else "eval"
        context = f"{self._model_name} ({mode} mode)"
        selectors = self._selectors
        unmatched = [] if selectors is None else [
            sel for sel in selectors if not any(sel(s) for s in p.sites)]
        if unmatched and strict:
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
            graph, order, copied = instrument(region, region_names, capture=capture, copy=copy)
            compiled[path] = compile_region(region, graph, order, copied)
        hook_paths = frozenset(s.name for s in selected if s.how == "hook")
        for s in selected:
            if s.how == "hook":
                self._hookset.ensure(s.name, root.get_submodule(s.name) if s.name else root)
        prog = Program(training, p, tuple(selected), compiled, hook_paths,
                       {s.name: i for i, s in enumerate(selected)})
        self._programs[training] = prog
        self._install_dispatch()
        return prog

    def _install_dispatch(self) -> None:
        paths = {path for prog in self._programs.values() for path in prog.compiled if path}
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
                return own_forward(module, *args, **kwargs)
            out, values = comp.fn(comp.holder, *args, **kwargs)
            if rec.active:
                rec.add(comp.names, values)
            return out

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
            if root is not None:
                out, values = root.fn(root.holder, *args, **kwargs)
                rec.add(root.names, values)
                return out
            return type(self._root).forward(self._root, *args, **kwargs)
        finally:
            rec.active = False

    def train(self, mode: bool = True) -> TappedModule:
        super().train(mode)
        self._root.training = mode
        return self

    # -- reading ----------------------------------------------------------------------------
    @property
    def taps(self) -> Taps:
        """The values the last forward captured, by site name."""
        prog = self._programs.get(self.training)
        if prog is None:
            prog = self._program()
        return Taps(self._rec, prog.order, list(prog.order))

    @property
    def sites(self) -> tuple[Site, ...]:
        """The selected sites (current mode), in execution order."""
        return self._program().selected

    @property
    def fallbacks(self) -> tuple[Fallback, ...]:
        """Modules that could not be traced and run as written (current mode), with why."""
        return tuple(self._program().plan.fallbacks)

    @property
    def graphs(self) -> dict[str, fx.Graph]:
        """The instrumented fx graph of each traced region with a tap, by module path."""
        return {path: c.graph for path, c in self._program().compiled.items()}

    def remove(self) -> None:
        """Remove every hook and override fxprobe installed; the last values stay readable."""
        self._hookset.remove()
        drop_overrides(self._root)
        self.__dict__["_removed"] = True

    def __enter__(self) -> TappedModule:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def extra_repr(self) -> str:
        prog = self._programs.get(self.training)
        if prog is None or self._removed:
            return "removed" if self._removed else ""
        hooks = sum(1 for s in prog.selected if s.how == "hook")
        return f"sites={len(prog.selected)} (fx={len(prog.selected) - hooks}, hook={hooks})"


def tap(model: nn.Module, ops: Any = None, *, capture: Capture = "output", detach: bool = True,
        copy: CopyPolicy = "auto", tracer: TracerKind = "auto",
        leaf_modules: Sequence[Any] = (), autowrap_functions: Sequence[Callable[..., Any]] = ()
        ) -> TappedModule:
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
    _check_choice("capture", capture, Capture)
    _check_choice("copy", copy, CopyPolicy)
    _check_choice("tracer", tracer, TracerKind)
    selectors = as_selectors(ops)
    return TappedModule(model, selectors, capture=capture, detach=bool(detach), copy=copy,
                        tracer=tracer, leaf_modules=leaf_modules,
                        autowrap_functions=autowrap_functions)


class SiteNames(tuple[str, ...]):
    """Site names in execution order; ``.records`` holds the :class:`Site` of each."""

    records: tuple[Site, ...]
    fallbacks: tuple[Fallback, ...]

    def __new__(cls, records: Sequence[Site], fallbacks: Sequence[Fallback]) -> SiteNames:
        self = super().__new__(cls, (s.name for s in records))
        self.records = tuple(records)
        self.fallbacks = tuple(fallbacks)
        return self


def sites(model: nn.Module, *, train: bool = False, tracer: TracerKind = "auto",
          leaf_modules: Sequence[Any] = (), autowrap_functions: Sequence[Callable[..., Any]] = ()
          ) -> SiteNames:
    """Every tappable site name of ``model``, in execution order (eval mode unless ``train``).

    Names follow torchvision's ``get_graph_node_names``; inside modules that cannot be traced,
    module calls are listed by path in registration order. The model is not modified.

    Example:
        >>> fxprobe.sites(model)[:3]
        ('x', 'conv1', 'bn1')
    """
    check_model(model)
    _check_choice("tracer", tracer, TracerKind)
    root = mirror(model)
    root.train(train)
    p = plan(root, tracer=tracer, leaf_modules=leaf_modules,
             autowrap_functions=autowrap_functions)
    return SiteNames(p.sites, p.fallbacks)
