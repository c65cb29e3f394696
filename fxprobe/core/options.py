"""The options of ``fxprobe.tap``, declared once (:class:`TapKwargs`: one line a field, with its
type and default), and :class:`TapOptions`, the same once validated.

``fxprobe.tap``, ``fxprobe.sites`` and ``fxprobe.extractor`` take them as
``**options: Unpack[...]``; :func:`keywords` gives each its introspectable signature from the
declaration, and :func:`arguments` checks the keywords given and fills in the defaults.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import (
    Annotated,
    Any,
    Literal,
    TypedDict,
    TypeVar,
    get_args,
    get_type_hints,
)

import torch

from .errors import ConfigError
from .names import did_you_mean
from .site import Site

Capture = Literal["output", "input", "both"]
CopyPolicy = Literal["auto", "always", "never"]
TracerKind = Literal["auto", "fx", "hooks", "dynamo", "fx+dynamo"]
Reduce = Literal["stats", "sample"]


class Sink:
    """What ``to=`` takes besides a device: an object that receives each forward's values
    (``fxprobe.Disk`` subclasses it). Defined here, below the sinks, so that validating
    ``to=`` needs no sink; the tapped module calls :meth:`attach` once, :meth:`write` after
    each forward (once its selectors are known to select), :meth:`release` when its first
    forward's selection failed, and :meth:`close` on ``remove()``."""

    def check_options(self, keep: int | None) -> None:
        """Refuse ``fxprobe.tap`` options this sink cannot serve (``keep`` as validated); raise
        :class:`~fxprobe.ConfigError` with what to pass instead."""

    def attach(self, module: Any) -> None:
        """Called by ``fxprobe.tap`` with the tapped module that writes here."""

    def write(self, values: Mapping[str, Any], inputs: Any = ()) -> None:
        """Take one forward's ``{site name: value}``; ``inputs`` are the forward's arguments
        (values that share their storage must be copied before this returns)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Wait until what was written is stored."""

    def release(self) -> None:
        """The tapped module will write nothing here (its selection failed at its first
        forward): let go of what the sink holds for writing until the next :meth:`write`."""

    def close(self) -> None:
        """Flush and release what the sink holds."""


class Default:
    """The default of an option, as the declaration's ``Annotated`` metadata carries it."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class TraceOptions(TypedDict, total=False):
    """How fxprobe reaches a model's code (``fxprobe.tap``, ``fxprobe.sites``,
    ``fxprobe.extractor``); see ``fxprobe.tap``'s docstring for each."""

    tracer: Annotated[TracerKind, Default("auto")]
    leaf_modules: Annotated[Sequence[Any], Default(())]
    autowrap_functions: Annotated[Sequence[Callable[..., Any]], Default(())]


class TapKwargs(TraceOptions, total=False):
    """Every keyword option of ``fxprobe.tap``, one line each (:class:`TapOptions` once checked).

    A new option is one line here, one field of :class:`TapOptions`, and its check in
    :func:`make_options`; ``tap``'s signature and defaults follow from this declaration.
    """

    capture: Annotated[Capture, Default("output")]
    detach: Annotated[bool, Default(True)]
    copy: Annotated[CopyPolicy, Default("auto")]
    reduce: Annotated[Reduce | Callable[[torch.Tensor], Any] | None, Default(None)]
    sample_size: Annotated[int, Default(1024)]
    seed: Annotated[int, Default(0)]
    keep: Annotated[int | str, Default("last")]
    to: Annotated[str | torch.device | Sink | None, Default(None)]
    fn: Annotated[Callable[[Site, Any], Any] | None, Default(None)]
    grad: Annotated[bool, Default(False)]
    grad_fn: Annotated[Callable[[Site, torch.Tensor], Any] | None, Default(None)]
    gather: Annotated[bool, Default(False)]


_DECLARED = re.compile(r"^Annotated\[(.*), Default\((.*)\)\]$", re.S)


def declared(options: type) -> dict[str, tuple[str, Any]]:
    """``{name: (annotation as written, default)}`` of a declaration, in order."""
    out: dict[str, tuple[str, Any]] = {}
    for name, hint in get_type_hints(options, include_extras=True).items():
        raw = options.__annotations__[name]
        text = getattr(raw, "__forward_arg__", raw)
        m = _DECLARED.match(text) if isinstance(text, str) else None
        default = next(x.value for x in hint.__metadata__ if isinstance(x, Default))
        out[name] = (m.group(1) if m else str(text), default)
    return out


F = TypeVar("F", bound=Callable[..., Any])


def keywords(options: type, **defaults: Any) -> Callable[[F], F]:
    """Give a function taking ``**options: Unpack[options]`` the signature it has: its own
    parameters, then each declared option as a keyword-only parameter with its type and
    default (``defaults`` overrides some, as ``extractor``'s ``tracer="fx"``), so that
    ``help()``, ``inspect.signature`` and IDEs show every option."""

    def decorate(func: F) -> F:
        sig = inspect.signature(func)
        own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        declared_ = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                       default=defaults.get(name, default), annotation=text)
                     for name, (text, default) in declared(options).items()]
        func.__signature__ = sig.replace(parameters=[*own, *declared_])  # type: ignore[attr-defined]
        return func

    return decorate


def arguments(options: type, given: Mapping[str, Any], where: str, **defaults: Any
              ) -> dict[str, Any]:
    """Every option of ``options`` (a declaration), ``given`` or its default (``defaults``
    overriding the declared ones).

    Raises:
        TypeError: a keyword that is no option (as Python says it, with the closest names).
    """
    known = declared(options)
    for name in given:
        if name not in known:
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}."
                            f"{did_you_mean(name, known)}")
    return {name: given[name] if name in given else defaults.get(name, default)
            for name, (_, default) in known.items()}


def check_choice(name: str, value: Any, allowed: Any) -> None:
    choices = get_args(allowed)
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(
            f"{name}={value!r} is not accepted; use one of {', '.join(map(repr, choices))}"
        )


TABLE_FORMATS = {"text": "simple", "github": "github", "markdown": "github", "html": "html"}
"""fxprobe's names of table formats, each with the ``tabulate`` format it is; a ``tabulate``
format name (``"simple"``, ``"plain"``, ``"grid"`` ...) is accepted as well."""


def table_format(fmt: Any) -> str:
    """The ``tabulate`` format that ``fmt=`` names, or :class:`~fxprobe.ConfigError`.

    The one check of ``fmt=`` for every table fxprobe prints (``summary``, ``Table.render``,
    ``stats_table`` and the stats loggers): one of :data:`TABLE_FORMATS` or a ``tabulate``
    format name.
    """
    if isinstance(fmt, str):
        if fmt in TABLE_FORMATS:
            return TABLE_FORMATS[fmt]
        from tabulate import tabulate_formats

        if fmt in tabulate_formats:
            return fmt
    raise ConfigError(
        f"fmt={fmt!r} is not a table format; use one of {', '.join(map(repr, TABLE_FORMATS))} "
        "(or a tabulate format: 'simple', 'plain', 'grid', ...)"
    )


def check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not accepted; use True or False")


def check_sequence(name: str, value: Any, example: str) -> list[Any]:
    """A list of ``value``'s entries; one type or string alone counts as a list of one."""
    if isinstance(value, (str, type)):
        return [value]
    try:
        return list(value)
    except TypeError:
        raise ConfigError(
            f"{name}={value!r} is not accepted; pass a list ({example})"
        ) from None


@dataclass(frozen=True)
class TapOptions:
    """How a tapped module captures, once validated."""

    capture: Capture = "output"
    """What to keep of a site: its output, its inputs, or both."""
    detach: bool = True
    """Keep captured tensors out of the autograd graph."""
    copy: CopyPolicy = "auto"
    """When to copy a value that a later in-place op would overwrite."""
    tracer: TracerKind = "auto"
    """How to reach the model: fx, then dynamo, then hooks ("auto"), or one frontend alone."""
    leaf_modules: tuple[Any, ...] = ()
    """Module types or paths that are not traced into."""
    autowrap_functions: tuple[Callable[..., Any], ...] = ()
    """Functions recorded as single calls."""
    reduce: Reduce | Callable[[torch.Tensor], Any] | None = None
    """Keep a reduction of each tensor instead of the tensor."""
    sample_size: int = 1024
    """Elements kept per tensor by ``reduce="sample"``."""
    seed: int = 0
    """Seed of the subsample drawn by ``reduce="sample"`` (the same positions every forward)."""
    keep: int | None = 1
    """How many forwards to keep (None: all)."""
    to: torch.device | None = None
    """Device captured values are copied to, without blocking (``"cpu"``: pinned memory)."""
    fn: Callable[[Any, Any], Any] | None = None
    """``fn(site, value)`` at each tap; a returned tensor replaces the value downstream."""
    grad: bool = False
    """Keep the gradient of the loss with respect to each tapped value."""
    grad_fn: Callable[[Any, torch.Tensor], Any] | None = None
    """``grad_fn(site, grad)`` on each such gradient; a returned tensor replaces it."""
    sink: Sink | None = None
    """``to=fxprobe.Disk(...)``: receives each forward's values (``write``/``flush``/``close``)."""
    gather: bool = False
    """Under tensor parallelism, tap (keep, edit) each sharded value whole, gathered from every
    rank, instead of this rank's part (``Site.sharding`` says which part; docs/distributed.md)."""

    @property
    def wants_grads(self) -> bool:
        return self.grad or self.grad_fn is not None


def make_options(**given: Any) -> TapOptions:
    """Validate ``fxprobe.tap``'s options (:class:`TapKwargs`; those not ``given`` at their
    defaults); every refusal says what to pass instead."""
    o = arguments(TapKwargs, given, "fxprobe.tap")
    capture, detach, copy, tracer = o["capture"], o["detach"], o["copy"], o["tracer"]
    leaf_modules, autowrap_functions = o["leaf_modules"], o["autowrap_functions"]
    reduce, sample_size, seed, keep, to = (o["reduce"], o["sample_size"], o["seed"], o["keep"],
                                           o["to"])
    fn, grad, grad_fn, gather = o["fn"], o["grad"], o["grad_fn"], o["gather"]
    check_choice("capture", capture, Capture)
    check_choice("copy", copy, CopyPolicy)
    check_choice("tracer", tracer, TracerKind)
    for name, flag in (("detach", detach), ("grad", grad), ("gather", gather)):
        check_flag(name, flag)
    leaf_modules = check_sequence("leaf_modules", leaf_modules, "e.g. [MyBlock, 'encoder.0']")
    autowrap_functions = check_sequence("autowrap_functions", autowrap_functions,
                                        "e.g. [my_helper]")
    for leaf in leaf_modules:
        if not isinstance(leaf, (str, type)):
            raise ConfigError(
                f"leaf_modules entry {leaf!r} is neither a module type nor a qualified path; "
                "pass e.g. leaf_modules=[MyBlock, 'encoder.layer.0']"
            )
    for f in autowrap_functions:
        if not callable(f):
            raise ConfigError(f"autowrap_functions entry {f!r} is not callable")
    if reduce is not None and not callable(reduce):
        check_choice("reduce", reduce, Reduce)
    if reduce is not None and not detach:
        raise ConfigError(
            f"reduce={getattr(reduce, '__name__', reduce)!r} keeps reductions, which are not "
            "part of the autograd graph; drop detach=False, or drop reduce= to keep the "
            "tensors themselves"
        )
    if isinstance(sample_size, bool) or not isinstance(sample_size, int) or sample_size < 1:
        raise ConfigError(f"sample_size={sample_size!r} must be a positive int")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed={seed!r} must be an int")
    if keep == "last":
        keep_n: int | None = 1
    elif keep == "all":
        keep_n = None
    elif isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1:
        keep_n = keep
    else:
        raise ConfigError(
            f"keep={keep!r} is not accepted; use 'last', 'all' or a number of forwards >= 1"
        )
    device = None
    sink = None
    if isinstance(to, Sink):  # not a device: a sink that receives each forward's values
        to.check_options(keep_n)
        sink, to = to, None
    if to is not None and callable(to):
        what = getattr(to, "__name__", None) or f"{type(to).__name__}(...)"
        raise ConfigError(
            f"to={what} is not accepted: to= takes a device ('cpu', 'cuda', "
            "'cuda:N') or a sink: fxprobe.Disk(path), fxprobe.CallbackSink(fn) or "
            "fxprobe.TensorBoardSink(writer) (every forward's statistics). A function called "
            "as sink(step, stats) every N steps goes to a stats logger: "
            "fxprobe.StatsLogger(tapped, every=N, sink=...), stepped after each forward; a "
            "function called at each site with its value is fn="
        )
    if to is not None:
        try:
            device = torch.device(to)
        except (RuntimeError, TypeError, ValueError) as e:
            raise ConfigError(
                f"to={to!r} is not a device torch knows ({e}); use 'cpu', 'cuda' or 'cuda:N'"
            ) from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"to={to!r} names a CUDA device but CUDA is not available here")
    for name, f in (("fn", fn), ("grad_fn", grad_fn)):
        if f is not None and not callable(f):
            raise ConfigError(f"{name}={f!r} must be a callable taking (site, value)")
    if (grad or grad_fn is not None) and capture == "input":
        raise ConfigError(
            "grad=True needs capture='output' or 'both' (got capture='input'): gradients are "
            "kept of each site's output, and with 'both' of its inputs too (grads[name] is then "
            "an InOut of grad_input and grad_output, as a full backward hook gives them)"
        )
    if fn is not None and capture == "input":
        raise ConfigError(
            "fn= replaces a site's output, so it needs capture='output' or 'both', "
            "not capture='input'"
        )
    return TapOptions(capture, bool(detach), copy, tracer, tuple(leaf_modules),
                      tuple(autowrap_functions), reduce, sample_size, seed, keep_n, device, fn,
                      bool(grad), grad_fn, sink, bool(gather))


TAP_DEFAULTS: dict[str, Any] = {name: d for name, (_, d) in declared(TapKwargs).items()}
"""``fxprobe.tap``'s defaults, from :class:`TapKwargs`."""
