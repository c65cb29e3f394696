"""``fxprobe.extractor``: a pure ``fx.GraphModule`` returning ``(output, {site: value})``.

Where :func:`fxprobe.tap` records values as a side effect and falls back to hooks, the extractor
is one graph with no side effects at all, so that ``torch.compile(fullgraph=True)``,
``torch.export.export`` and (when every captured value is a tensor) ``torch.jit.script`` can take
it whole. It is built from the same tracing, site names, selectors and in-place analysis as
``tap``: a value that a later in-place op overwrites is copied where it is produced, by a
``.clone()`` node when the value is known to be a tensor.
"""

from __future__ import annotations

import operator
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ._errors import ConfigError, TraceError, UnsupportedModelError
from ._inplace import Hazards
from ._mirror import mirror
from ._select import as_selectors, select
from ._site import is_torch_callable
from ._tap import check_model
from ._trace import Fallback, Region, plan

# torch.nn modules that always return one tensor (pooling only without return_indices).
_TENSOR_MODULES: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag,
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LayerNorm,
    nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
    nn.LocalResponseNorm, nn.RMSNorm,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.RReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
    nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh,
    nn.Softplus, nn.Softsign, nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.GLU, nn.LogSigmoid,
    nn.Threshold, nn.Tanhshrink, nn.Softshrink, nn.Hardshrink,
    nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d, nn.LPPool1d, nn.LPPool2d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.Flatten, nn.Unflatten, nn.Upsample, nn.PixelShuffle, nn.PixelUnshuffle,
)
# Modules that hand back their input (Dropout in eval): a tensor exactly when the input is.
_PASS_THROUGH: tuple[type[nn.Module], ...] = (
    nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)
# Tensor methods that return one tensor (``max``, ``sort``, ``split``... return tuples).
_TENSOR_METHODS = frozenset("""
view view_as reshape reshape_as flatten unflatten ravel transpose t permute squeeze unsqueeze
expand expand_as broadcast_to narrow select index_select movedim moveaxis swapaxes swapdims
diagonal unfold detach contiguous to type_as float double half bfloat16 int long short bool
clone repeat tile roll flip masked_fill where lerp maximum minimum clamp clip clamp_min
clamp_max add sub mul div true_divide floor_divide remainder fmod pow matmul mm bmm addmm mv dot
neg abs exp exp2 expm1 log log2 log10 log1p sqrt rsqrt sigmoid tanh relu sin cos tan atan
atan2 erf sign floor ceil round trunc frac reciprocal square sum mean prod std var norm amax
amin argmax argmin all any logsumexp cumsum cumprod softmax log_softmax eq ne lt le gt ge
logical_and logical_or logical_not logical_xor bitwise_and bitwise_or bitwise_xor bitwise_not
gather scatter scatter_add index_add masked_scatter new_zeros new_ones new_empty new_full
""".split())
# torch.* and torch.nn.functional.* functions that return one tensor (torch.where(cond) does not).
_TENSOR_FUNCTIONS = (_TENSOR_METHODS - {"where"}) | frozenset("""
cat concat concatenate stack hstack vstack einsum relu relu6 gelu silu mish hardswish
hardsigmoid hardtanh leaky_relu elu selu celu softplus softsign glu logsigmoid tanhshrink
layer_norm group_norm batch_norm instance_norm rms_norm local_response_norm normalize linear
bilinear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d avg_pool1d
avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d dropout
dropout1d dropout2d dropout3d alpha_dropout embedding interpolate pad pixel_shuffle
scaled_dot_product_attention zeros_like ones_like empty_like full_like rand_like randn_like
""".split())
# Operators whose result is a tensor when one operand is.
_TENSOR_OPERATORS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
    operator.pow, operator.matmul, operator.neg, operator.pos, operator.abs, operator.invert,
    operator.and_, operator.or_, operator.xor, operator.lshift, operator.rshift, operator.eq,
    operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.getitem,
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor,
})


def extractor(model: nn.Module, ops: Any = None, *, tracer: str = "fx",
              leaf_modules: Sequence[Any] = (),
              autowrap_functions: Sequence[Callable[..., Any]] = (),
              train: bool = False) -> fx.GraphModule:
    """A module whose forward returns ``(model output, {site name: value})``, side-effect free.

    The result is an ``fx.GraphModule`` traced once, in eval mode unless ``train``. It shares
    every parameter and buffer with ``model`` (training it trains the model) and leaves the model
    object untouched. A value that a later in-place op would overwrite (``ReLU(inplace=True)``
    after a BatchNorm, ``+=``) is copied where it is produced, so each value is the one the site
    computed. It compiles with ``torch.compile(fullgraph=True)``, exports with
    ``torch.export.export`` and scripts with ``torch.jit.script`` when every selected value is a
    tensor (see docs/extractor.md).

    Args:
        model: an ``nn.Module`` that ``torch.fx`` can trace whole (with ``leaf_modules``).
        ops: ``None`` (every site, inputs and attributes included), a selector, or a list of
            selectors, as in :func:`fxprobe.tap`.
        tracer: only ``"fx"``: an extractor is one graph, so there is no hook fallback.
        leaf_modules: module types or qualified paths kept as single calls (not traced into;
            their insides cannot be selected).
        autowrap_functions: functions recorded as single calls instead of traced into.
        train: trace the training-mode forward (and return the module in training mode).
            The graph's control flow is fixed at trace time; ``.train()``/``.eval()`` on the
            result only switches what leaf modules such as BatchNorm and Dropout do.

    Returns:
        An ``fx.GraphModule`` named like the model's class.

    Raises:
        TraceError: part of the model cannot be traced; the message names each such module.
        SelectorError: a selector matches no site. SelectorTypeError: a selector of unknown
        type. ConfigError: ``tracer`` is not ``"fx"``. UnsupportedModelError: not an
        ``nn.Module``, a TorchScript module, or a container without a forward.

    Example:
        >>> ex = fxprobe.extractor(model, ops=[nn.Conv2d, "layer1.*"])
        >>> out, feats = torch.compile(ex, fullgraph=True)(x)
    """
    check_model(model)
    if tracer != "fx":
        raise ConfigError(
            f"extractor(tracer={tracer!r}) is not accepted: an extractor is one fx graph of the "
            "whole model, so only tracer='fx' is; use fxprobe.tap(model, tracer=...) to reach "
            "untraceable modules by hooks"
        )
    selectors = as_selectors(ops)
    root = mirror(model)
    root.train(train)
    # "auto" lists every module that fails (as Fallbacks) instead of stopping at the first.
    with StateWriteGuard(root):
        p = plan(root, tracer="auto", leaf_modules=leaf_modules,
                 autowrap_functions=autowrap_functions)
    if p.fallbacks:
        raise _untraceable(type(model).__name__, p.fallbacks)
    region = p.root_region
    if region is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} is a container without a forward of its own; pass a module "
            "whose forward runs it (for an nn.ModuleList, the module that iterates over it)"
        )
    mode = "train" if train else "eval"
    selected = select(p.sites, selectors, context=f"{type(model).__name__} ({mode} mode)")
    graph = build_graph(region, {s.name for s in selected})
    gm = fx.GraphModule(root, graph, class_name=type(model).__name__)
    gm.train(train)
    return gm


_INPLACE_DUNDERS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
    "__setitem__",
})


class StateWriteGuard(TorchFunctionMode):
    """While tracing, refuse in-place writes into the model's parameters and buffers.

    fx records operations on proxies only; buffers are real tensors during tracing, so
    ``self.count += 1`` or an observer's ``self.min_val.copy_(...)`` would run once, on the
    model's own tensor, and be missing from the graph. Raising instead makes the module fail to
    trace (before anything is written), so that it is reported by name.
    """

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.owned: dict[int, str] = {}
        named = [*root.named_parameters(remove_duplicate=False),
                 *root.named_buffers(remove_duplicate=False)]
        for name, t in named:
            ptr = _storage_ptr(t)
            if ptr is not None:
                self.owned.setdefault(ptr, name)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        targets: list[Any] = []
        if (_inplace_name(name) or name in _INPLACE_DUNDERS
                or kwargs.get("inplace") is True) and args:
            targets.append(args[0])
        if kwargs.get("out") is not None:
            targets.append(kwargs["out"])
        for t in targets:
            owner = self.owned.get(_storage_ptr(t) or -1) if isinstance(t, torch.Tensor) else None
            if owner is not None:
                raise RuntimeError(
                    f"the forward writes in place into the model's tensor {owner!r} "
                    f"({name}), which torch.fx cannot record"
                )
        return func(*args, **kwargs)


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None
    return ptr or None


def copy_tree(value: Any) -> Any:
    """A copy of every tensor in ``value`` (a nest of tuples, lists and dicts); the rest as is."""
    if isinstance(value, fx.Proxy):
        # Unpickling a GraphModule traces its code again: stay one node instead of vanishing.
        return value.tracer.create_proxy("call_function", copy_tree, (value,), {})
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, value)


def build_graph(region: Region, selected: set[str]) -> fx.Graph:
    """Copy the region's graph; make it return ``(output, {name: value})``, copying at risk."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in region.graph.nodes:
        if node.op != "output":
            env[node] = graph.node_copy(node, lambda n: env[n])
    _resolve_placeholder_types(graph, region.module)
    hazards = Hazards(graph, region.module.get_submodule)
    tensors = known_tensors(graph, region.module)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    values: dict[str, fx.Node] = {}
    for node in region.graph.nodes:
        name = region.names.get(node)
        if name is None or name not in selected or node.op == "output":
            continue
        new = env[node]
        value = new
        if new.op != "get_attr" and hazards.output_at_risk(new):
            # Placeholders must stay together at the top of the graph.
            after = placeholders[-1] if new.op == "placeholder" else new
            with graph.inserting_after(after):
                if new in tensors:  # a method call: torch.jit.script can compile it
                    value = graph.call_method("clone", (new,))
                else:  # type unknown (a tuple, an int...): copy every tensor inside it
                    value = graph.call_function(copy_tree, (new,))
            if new.op == "placeholder":
                placeholders.append(value)
        values[name] = value
    (old_out,) = (n for n in region.graph.nodes if n.op == "output")
    result = fx.node.map_arg(old_out.args[0], lambda n: env[n])
    graph.output((result, values))  # untyped: the model's return annotation no longer holds
    graph.lint()
    return graph


def known_tensors(graph: fx.Graph, root: nn.Module) -> set[fx.Node]:
    """Nodes whose value is sure to be a single tensor (a conservative answer)."""
    known: set[fx.Node] = set()

    def first_known(n: fx.Node) -> bool:
        return bool(n.args) and isinstance(n.args[0], fx.Node) and n.args[0] in known

    for n in graph.nodes:
        is_tensor = False
        if n.op == "placeholder":
            is_tensor = n.type is torch.Tensor
        elif n.op == "get_attr":
            is_tensor = isinstance(_get_attr(root, str(n.target)), torch.Tensor)
        elif n.op == "call_module":
            m = root.get_submodule(str(n.target))
            if isinstance(m, _PASS_THROUGH):
                is_tensor = first_known(n)
            else:
                is_tensor = isinstance(m, _TENSOR_MODULES) and not getattr(
                    m, "return_indices", False)
        elif n.op == "call_method":
            name = str(n.target)
            is_tensor = first_known(n) and (name in _TENSOR_METHODS or _inplace_name(name))
        elif n.op == "call_function":
            fn = n.target
            if fn in _TENSOR_OPERATORS:
                is_tensor = any(isinstance(a, fx.Node) and a in known for a in n.args[:2])
                if fn is operator.getitem:
                    is_tensor = first_known(n)
            elif is_torch_callable(fn):
                name = getattr(fn, "__name__", "")
                is_tensor = name in _TENSOR_FUNCTIONS or _inplace_name(name)
        if is_tensor:
            known.add(n)
    # Whatever an in-place tensor op writes into is a tensor, even an unannotated input.
    for n in graph.nodes:
        target = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if target is None:
            continue
        if n.op == "call_method" and _inplace_name(str(n.target)):
            known.add(target)
        elif n.op == "call_function" and is_torch_callable(n.target) and (
                _inplace_name(getattr(n.target, "__name__", ""))
                or n.kwargs.get("inplace") is True):
            known.add(target)
        elif n.op == "call_module":
            m = root.get_submodule(str(n.target))
            if isinstance(m, _TENSOR_MODULES) and getattr(m, "inplace", False) is True:
                known.add(target)
    return known


def _inplace_name(name: str) -> bool:
    return name.endswith("_") and not name.startswith("_")


def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _resolve_placeholder_types(graph: fx.Graph, module: nn.Module) -> None:
    """Turn string annotations (``from __future__ import annotations``) into types.

    fx keeps them as strings and prints them as undefined names (``_torch_Tensor_``) that
    ``torch.jit.script`` cannot resolve; one that cannot be evaluated is dropped (TorchScript
    then assumes ``Tensor``).
    """
    strings = [n for n in graph.nodes if n.op == "placeholder" and isinstance(n.type, str)]
    if not strings:
        return
    try:
        hints = typing.get_type_hints(type(module).forward)
    except Exception:  # any annotation that does not evaluate: keep none of them
        hints = {}
    for n in strings:
        n.type = hints.get(str(n.target).lstrip("*"))


def _untraceable(model_name: str, fallbacks: Sequence[Fallback]) -> TraceError:
    lines = []
    for f in fallbacks:
        what = (f"module {f.path!r} ({f.module_type.__name__})" if f.path
                else f"the top-level forward of {f.module_type.__name__}")
        lines.append(f"  - {what}: {f.error}" + (f"\n      at {f.location}" if f.location else ""))
    paths = [f.path for f in fallbacks if f.path]
    hints = []
    if paths:
        hints.append(
            f"pass leaf_modules={paths!r} (paths or types) to keep them as single calls, whose "
            "insides are then not captured")
    if any(not f.path for f in fallbacks):
        hints.append(
            "leaf_modules cannot help with the top-level forward: build the extractor from a "
            "traceable submodule, move the code that fails into a submodule named in "
            "leaf_modules, or name the offending function in autowrap_functions")
    hints.append("or use fxprobe.tap(model, ...), which reaches untraceable modules by hooks")
    return TraceError(
        f"fxprobe.extractor needs one fx graph of the whole {model_name}, but torch.fx could "
        "not trace:\n" + "\n".join(lines) + "\nTo fix: " + "; ".join(hints) + "."
    )
