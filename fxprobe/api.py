"""The entry points: ``fxprobe.tap`` (a model or a deployed artifact in, a tapped module or
artifact out) and ``fxprobe.sites`` (the names a model's sites will have). They check what they
are given and hand it to the runtime (``_tap.TappedModule``) or to the artifact frontends."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Unpack, overload

import torch
from torch import nn

from .core.errors import ConfigError
from .core.options import (
    TapKwargs,
    TraceOptions,
    TracerKind,
    arguments,
    check_choice,
    check_flag,
    check_sequence,
    keywords,
    make_options,
)
from .core.select import as_selectors, paths_in
from .frontends.sharding import check_tracer
from .runtime.artifact import TappedArtifact, artifact_kind, artifact_sites, tap_artifact
from .runtime.program import SiteNames, check_model, list_sites
from .runtime.tapped import TappedModule

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from .runtime.artifact import TappedExport, TappedScript


@overload
def tap(  # type: ignore[overload-overlap]  # a ScriptModule is an nn.Module too
        model: torch.jit.ScriptModule, ops: Any = None, **options: Unpack[TapKwargs]
        ) -> TappedScript: ...


@overload
def tap(model: ExportedProgram, ops: Any = None, **options: Unpack[TapKwargs]
        ) -> TappedExport: ...


@overload
def tap(model: nn.Module, ops: Any = None, **options: Unpack[TapKwargs]) -> TappedModule: ...


@keywords(TapKwargs)
def tap(model: Any, ops: Any = None, **options: Unpack[TapKwargs]
        ) -> TappedModule | TappedArtifact:
    """Tap ``model`` at the sites ``ops`` selects; run the result like the model.

    Args:
        model: any ``nn.Module``, a TorchScript module (scripted, traced or loaded) or a
            ``torch.export`` ExportedProgram; it is never modified. See docs/artifacts.md.
        ops: ``None`` (every site), a selector, or a list of selectors (their union): an
            ``nn.Module`` type, a module of the model (``model.conv1``: its calls), a function
            or operator, a glob on site names, a ``re.Pattern``, or ``fxprobe.where(predicate)``.
        capture: ``"output"``, ``"input"`` or ``"both"``.
        detach: keep captured tensors out of the autograd graph (the default).
        copy: ``"auto"`` copies a value only when a later in-place op would overwrite it;
            ``"always"`` or ``"never"``.
        tracer: ``"auto"`` traces with torch.fx what it can, captures each module fx cannot
            trace with torch dynamo at its first call, and runs a module that dynamo fails on
            too as written, reaching the module calls inside it by hooks
            (``tapped.fallbacks`` says why). Before the first forward ``tapped.sites`` lists
            what fx and hooks know; dynamo's sites replace the hooked ones as the first
            forward captures them. A model fx traces whole never meets dynamo.
            ``"fx+dynamo"``: the same without hooks, sites inside dynamo's modules known only
            after the first forward; ``"dynamo"``: the whole model under dynamo
            (docs/transformers.md); ``"fx"`` fails if anything cannot be traced; ``"hooks"``
            uses hooks only.
        leaf_modules: module types or qualified paths not to trace into.
        autowrap_functions: functions to record as single calls instead of tracing into.
        reduce: keep a reduction instead of each tensor: ``"stats"`` (a :class:`Stats` per
            tensor, computed on its device without a host sync), ``"sample"`` (``sample_size``
            elements drawn with ``seed``, the same positions every forward), or a function of
            a tensor returning tensors.
        sample_size: elements kept per tensor by ``reduce="sample"``.
        seed: seed of ``reduce="sample"``'s positions (the same every forward).
        keep: ``"last"`` forward (default), a number N of forwards (``tapped.history``), or
            ``"all"`` (memory grows with every forward).
        to: copy captured values to this device without blocking (``"cpu"``: pinned memory);
            reading a value waits for its own copy only. Or a :class:`fxprobe.Disk`: stream
            every forward's values to files in the background (``docs/disk.md``).
        fn: ``fn(site, value)`` runs at each tap; returning a tensor replaces the value for
            every downstream consumer (``None`` observes).
        grad: after ``backward()``, ``tapped.grads[name]`` is the gradient with respect to
            each tapped value.
        grad_fn: ``grad_fn(site, grad)`` on each such gradient; a returned tensor replaces it.
        gather: under tensor parallelism, each sharded value (``site.sharding``) is tapped
            whole, gathered from every rank (one collective per sharded site and forward),
            and an edit of it flows on as this rank's part; the default, False, taps this
            rank's part as the model holds it (docs/distributed.md).

    Returns:
        A :class:`TappedModule`; a :class:`TappedScript` for a ScriptModule, a
        :class:`TappedExport` for an ExportedProgram.

    Raises:
        SelectorError: a selector matches no site (with modules that dynamo captures, at the
        end of the first forward if it matches none before). SelectorTypeError: a selector
        of unknown
        type. TraceError: ``tracer="fx"`` and part of the model cannot be traced.
        UnsupportedModelError: not an ``nn.Module``. ConfigError: an option a deployed
        artifact cannot honour (``fn=``, ``grad=``, ``capture="input"``, ...).

    Example:
        >>> tapped = fxprobe.tap(model, ops=[nn.Conv2d, torch.flatten])
        >>> out = tapped(x); tapped.taps["flatten"].shape
    """
    if artifact_kind(model) is not None:  # a ScriptModule or an ExportedProgram
        return tap_artifact(model, ops, **options)
    model = check_model(model)
    made = make_options(**options)
    check_tracer(model, made.tracer)  # tensor parallelism is followed under dynamo
    return TappedModule(model, as_selectors(ops, paths_in(model)), made)


@keywords(TraceOptions)
def sites(model: Any, *, train: bool = False, example_input: Any = None,
          example_kwargs: dict[str, Any] | None = None, **options: Unpack[TraceOptions]
          ) -> SiteNames:
    """Every tappable site name of ``model``, in execution order (eval mode unless ``train``).

    Names follow torchvision's ``get_graph_node_names``; inside modules that cannot be traced,
    module calls are listed by path in registration order. The model is not modified.
    A ScriptModule or an ExportedProgram is read from its graph (``train`` and the tracing
    arguments do not apply; see docs/artifacts.md).

    With ``tracer="dynamo"`` or ``"fx+dynamo"``, the sites of modules that dynamo captures are
    found by running them: pass ``example_input`` (a tensor or a tuple of positional
    arguments) and/or ``example_kwargs``; they are listed after the other sites, in the order
    the forward reached them.

    With ``tracer="auto"`` (the default) and no example input, the answer is what fx and hooks
    know: fx's sites, and the module calls inside modules fx cannot trace. The op-level sites
    that torch dynamo finds inside those modules at a tapped model's first forward are listed
    only with ``example_input``/``example_kwargs`` (the model then runs once, on a copy of
    its module tree); they replace the module calls of the modules dynamo captured.

    Raises:
        ConfigError: ``tracer="dynamo"``/``"fx+dynamo"``, dynamo captures part of the model and
            no example input was given.

    Example:
        >>> fxprobe.sites(model)[:3]
        ('x', 'conv1', 'bn1')
        >>> fxprobe.sites(gpt2, tracer="dynamo", example_kwargs={"input_ids": ids})[:2]
        ('transformer.view', 'transformer.wte')
    """
    trace = arguments(TraceOptions, options, "fxprobe.sites")
    tracer, leaf_modules = trace["tracer"], trace["leaf_modules"]
    autowrap_functions = trace["autowrap_functions"]
    if artifact_kind(model) is not None:
        given = {k: v for k, v in (("train", train), ("tracer", tracer),
                                   ("leaf_modules", list(leaf_modules)),
                                   ("autowrap_functions", list(autowrap_functions)))
                 if v not in (False, "auto", [])}  # anything but the defaults
        return SiteNames(artifact_sites(model, **given), ())
    model = check_model(model, "fxprobe.sites")
    check_choice("tracer", tracer, TracerKind)
    check_flag("train", train)
    leaf_modules = check_sequence("leaf_modules", leaf_modules, "e.g. [MyBlock, 'encoder.0']")
    listed = list_sites(model, train=train, tracer=tracer, leaf_modules=leaf_modules,
                        autowrap_functions=autowrap_functions)
    if tracer in ("fx", "hooks") or (tracer == "auto" and example_input is None
                                      and example_kwargs is None):
        return listed
    # No selector at all: the probe taps nothing and checks nothing, it only finds sites.
    probe = TappedModule(model, [], make_options(
        tracer=tracer, leaf_modules=leaf_modules, autowrap_functions=autowrap_functions))
    probe.train(train)
    try:
        paths = [c.path for c in probe.dynamo_info]  # one per module torch dynamo runs
        if not paths:
            return listed
        if example_input is None and example_kwargs is None:
            raise ConfigError(
                f"torch dynamo captures {', '.join(repr(p) for p in paths)} of "
                f"{type(model).__name__}, whose sites are found by running it: pass "
                "example_input=(args...) and/or example_kwargs={...}, e.g. "
                "fxprobe.sites(model, tracer='dynamo', example_kwargs={'input_ids': ids})")
        args = example_input if isinstance(example_input, tuple) else (
            () if example_input is None else (example_input,))
        with torch.no_grad():
            probe(*args, **(example_kwargs or {}))
        return probe.known_sites()
    finally:
        probe.remove()
