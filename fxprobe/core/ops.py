"""Op knowledge in one place: canonical op names, views, in-place ops, what returns a tensor.

Every frontend and pass asks this module what an op is: its canonical key (``torch.add``,
``x + y``, ``x.add_(y)`` and ``aten::add`` are all ``add``), whether its result may share storage
with an argument, whether it writes one in place, and whether it returns exactly one tensor.
"""

from __future__ import annotations

import builtins
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_OPERATOR_KEYS = {
    operator.add: "add", operator.iadd: "add",
    operator.sub: "sub", operator.isub: "sub",
    operator.mul: "mul", operator.imul: "mul",
    operator.truediv: "div", operator.itruediv: "div",
    operator.floordiv: "floor_divide", operator.ifloordiv: "floor_divide",
    operator.mod: "remainder", operator.imod: "remainder",
    operator.pow: "pow", operator.ipow: "pow",
    operator.matmul: "matmul", operator.imatmul: "matmul",
    operator.neg: "neg", operator.pos: "positive", operator.abs: "abs",
    operator.and_: "bitwise_and", operator.iand: "bitwise_and",
    operator.or_: "bitwise_or", operator.ior: "bitwise_or",
    operator.xor: "bitwise_xor", operator.ixor: "bitwise_xor",
    operator.invert: "bitwise_not",
    operator.lshift: "bitwise_left_shift", operator.rshift: "bitwise_right_shift",
    operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le",
    operator.gt: "gt", operator.ge: "ge",
    operator.getitem: "getitem", operator.setitem: "setitem",
}
_METHOD_ALIASES = {
    "truediv": "div", "true_divide": "div", "floordiv": "floor_divide", "mod": "remainder",
    "multiply": "mul", "subtract": "sub", "divide": "div", "absolute": "abs",
    "negative": "neg", "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
    "invert": "bitwise_not", "lshift": "bitwise_left_shift", "rshift": "bitwise_right_shift",
}


def _normalize(name: str) -> str:
    """``__iadd__`` -> ``add``, ``relu_`` -> ``relu``, ``__rmul__`` -> ``mul``."""
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith(("i", "r")) and name[1:] in _DUNDER_BASES:
            name = name[1:]
    elif name.endswith("_") and not name.startswith("_"):
        name = name[:-1]
    return _METHOD_ALIASES.get(name, name)


_DUNDER_BASES = {
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
    "lshift", "rshift",
}


def is_torch_callable(fn: Any) -> bool:
    """True for functions and methods that belong to torch (``torch.add``, ``F.gelu``)."""
    objclass = getattr(fn, "__objclass__", None)
    if objclass is not None and isinstance(objclass, type) and issubclass(objclass, torch.Tensor):
        return True
    if objclass is not None and objclass.__name__ == "TensorBase":
        return True
    module = getattr(fn, "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")


def op_key(fn: Any) -> str | None:
    """The canonical op name of a function, or None if it has no torch-wide identity."""
    if fn in _OPERATOR_KEYS:
        return _OPERATOR_KEYS[fn]
    if is_torch_callable(fn):
        name = getattr(fn, "__name__", None)
        return _normalize(name) if name else None
    return None


def method_key(name: str) -> str:
    """The canonical op name of a tensor method call ``x.<name>(...)``."""
    return _normalize(name)


def describe_function(fn: Any) -> str:
    """``torch.flatten``, ``operator.add``, ``torch.nn.functional.relu``, ``my_fn``."""
    if fn in _OPERATOR_KEYS.keys() or getattr(builtins, getattr(fn, "__name__", ""), None) is fn:
        home = "operator" if fn in _OPERATOR_KEYS else "builtins"
        return f"{home}.{fn.__name__}"
    name: str = getattr(fn, "__name__", None) or repr(fn)
    if getattr(fn, "__objclass__", None) is not None and is_torch_callable(fn):
        return f"torch.Tensor.{name}"
    module: str | None = getattr(fn, "__module__", None)
    if module in (None, "torch._C._nn"):
        module = "torch.nn.functional" if module else None
    if module == "torch._C._VariableFunctions":
        module = "torch"
    return f"{module}.{name}" if module else name


def inplace_name(name: str) -> bool:
    return name.endswith("_") and not name.startswith("_")


# Ops whose output may share storage with their first tensor argument.
VIEW_OPS = frozenset("""
view view_as reshape reshape_as flatten unflatten ravel transpose t T mT H mH adjoint permute
squeeze unsqueeze expand expand_as broadcast_to narrow select index_select_view as_strided
unbind split chunk tensor_split split_with_sizes hsplit vsplit dsplit movedim moveaxis swapaxes
swapdims diagonal unfold detach contiguous to type type_as float double half bfloat16 int long
short bool char byte cpu cuda real imag view_as_real view_as_complex getitem alias data
align_to refine_names rename as_subclass requires_grad dropout feature_alpha_dropout
alpha_dropout dropout1d dropout2d dropout3d identity
""".split())
FRESH_OPS = frozenset("""
add sub mul div true_divide floor_divide remainder fmod pow matmul mm bmm addmm addmv addbmm
baddbmm mv dot outer neg abs exp exp2 expm1 log log2 log10 log1p sqrt rsqrt sigmoid tanh relu
relu6 gelu silu mish hardswish hardsigmoid hardtanh leaky_relu elu selu celu softplus softsign
glu logsigmoid tanhshrink softshrink hardshrink threshold rrelu prelu sin cos tan asin acos atan
atan2 sinh cosh erf erfc sign floor ceil round trunc frac reciprocal square clamp clip clamp_min
clamp_max maximum minimum lerp where masked_fill masked_scatter index_select gather scatter
scatter_add index_add index_copy index_fill index_put sum mean prod std var norm amax amin argmax
argmin all any logsumexp cumsum cumprod softmax log_softmax softmin max min sort topk kthvalue
median mode aminmax var_mean std_mean eq ne lt le gt ge logical_and logical_or logical_not
logical_xor bitwise_and bitwise_or bitwise_xor bitwise_not bitwise_left_shift
bitwise_right_shift isnan isinf isfinite clone repeat tile roll flip cat concat concatenate stack
hstack vstack layer_norm group_norm batch_norm instance_norm rms_norm local_response_norm
normalize linear bilinear conv1d conv2d conv3d conv_transpose1d conv_transpose2d
conv_transpose3d avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d
adaptive_avg_pool3d max_pool1d max_pool2d max_pool3d adaptive_max_pool1d adaptive_max_pool2d
adaptive_max_pool3d embedding interpolate pixel_shuffle pixel_unshuffle
scaled_dot_product_attention zeros_like ones_like empty_like full_like rand_like randn_like
new_zeros new_ones new_empty new_full tensor zeros ones empty full arange rand randn randint
cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss binary_cross_entropy
binary_cross_entropy_with_logits kl_div one_hot
size dim numel nelement ndimension stride storage_offset element_size is_contiguous
is_floating_point is_complex item tolist equal allclose get_device
""".split())
"""Torch functions and tensor methods whose result is always new memory (``x.relu()``,
``torch.cat``) or no tensor (``x.size()``): it shares storage with no argument. Any other
torch function is assumed to return an alias of its tensor arguments
(``torch.broadcast_tensors``, ``torch.as_tensor``, ``torch.positive``, ``torch.einsum``...):
a write through its result may write them."""

PASS_THROUGH_FUNCTIONS = frozenset({
    "torchvision.ops.stochastic_depth.stochastic_depth",
    "torchvision.models.swin_transformer.shifted_window_attention",
    "torchvision.models.swin_transformer._get_relative_position_bias",
})
"""Functions of other libraries (by ``module.name``) that fxprobe records as one call and that
return their first argument (or new memory) and write nothing: ``stochastic_depth`` hands
back its input in eval mode; Swin's attention writes only a clone of its bias."""

NO_TWIN = frozenset("""
requires_grad_ resize_ resize_as_ set_ detach_ share_memory_ t_ transpose_ swapdims_
swapaxes_ squeeze_ unsqueeze_ as_strided_ rename_ refine_names_ retain_grad_ copy_ fill_ zero_
""".split())
"""In-place ops never run out of place: they change what the tensor is (its shape, storage,
autograd state), or their ``x.<name>()`` twin is no out-of-place op of the same meaning."""

INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift, operator.imatmul, operator.setitem,
})
PURE_OPERATORS = frozenset(
    getattr(operator, n) for n in dir(operator)
    if not n.startswith("_") and callable(getattr(operator, n))
) - INPLACE_OPERATORS
NN_IDENTITY = (nn.Identity, nn.Flatten, nn.Unflatten, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
                nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
# torch.nn modules that always return one tensor (pooling only without return_indices).
TENSOR_MODULES: tuple[type[nn.Module], ...] = (
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
PASS_THROUGH: tuple[type[nn.Module], ...] = (
    nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)
# Tensor methods that return one tensor (``max``, ``sort``, ``split``... return tuples).
TENSOR_METHODS = frozenset("""
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
TENSOR_FUNCTIONS = (TENSOR_METHODS - {"where"}) | frozenset("""
cat concat concatenate stack hstack vstack einsum relu relu6 gelu silu mish hardswish
hardsigmoid hardtanh leaky_relu elu selu celu softplus softsign glu logsigmoid tanhshrink
layer_norm group_norm batch_norm instance_norm rms_norm local_response_norm normalize linear
bilinear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d avg_pool1d
avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d dropout
dropout1d dropout2d dropout3d alpha_dropout embedding interpolate pad pixel_shuffle
scaled_dot_product_attention zeros_like ones_like empty_like full_like rand_like randn_like
""".split())
# Operators whose result is a tensor when one operand is.
TENSOR_OPERATORS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
    operator.pow, operator.matmul, operator.neg, operator.pos, operator.abs, operator.invert,
    operator.and_, operator.or_, operator.xor, operator.lshift, operator.rshift, operator.eq,
    operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.getitem,
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor,
})


AUGMENTED_OPERATORS: dict[Any, Callable[[Any, Any], Any]] = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod, operator.ipow: operator.pow, operator.imatmul: operator.matmul,
    operator.iand: operator.and_, operator.ior: operator.or_, operator.ixor: operator.xor,
    operator.ilshift: operator.lshift, operator.irshift: operator.rshift,
}
"""Augmented assignment (``x += y`` is ``operator.iadd``: in place on a tensor, a new value on a
number) and its out-of-place twin, whose name fx gives the node (``add``: torchvision's)."""


INPLACE_DUNDERS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
    "__setitem__",
})
"""Tensor dunder methods that write their first operand in place."""


# Stateless torch.nn modules and the functional op each one calls: ``F.relu`` selects calls of
# ``nn.ReLU`` modules too.
MODULE_OPS: dict[type[nn.Module], str] = {
    nn.ReLU: "relu", nn.ReLU6: "relu6", nn.LeakyReLU: "leaky_relu", nn.ELU: "elu",
    nn.SELU: "selu", nn.CELU: "celu", nn.GELU: "gelu", nn.SiLU: "silu", nn.Mish: "mish",
    nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.Hardswish: "hardswish",
    nn.Hardsigmoid: "hardsigmoid", nn.Hardtanh: "hardtanh", nn.Softplus: "softplus",
    nn.Softsign: "softsign", nn.Softmax: "softmax", nn.LogSoftmax: "log_softmax",
    nn.Softmin: "softmin", nn.GLU: "glu", nn.LogSigmoid: "logsigmoid",
    nn.Threshold: "threshold", nn.Tanhshrink: "tanhshrink", nn.Softshrink: "softshrink",
    nn.Hardshrink: "hardshrink", nn.Flatten: "flatten", nn.Unflatten: "unflatten",
    nn.Dropout: "dropout", nn.Dropout1d: "dropout1d", nn.Dropout2d: "dropout2d",
    nn.Dropout3d: "dropout3d", nn.AlphaDropout: "alpha_dropout",
    nn.AvgPool1d: "avg_pool1d", nn.AvgPool2d: "avg_pool2d", nn.AvgPool3d: "avg_pool3d",
    nn.MaxPool1d: "max_pool1d", nn.MaxPool2d: "max_pool2d", nn.MaxPool3d: "max_pool3d",
    nn.AdaptiveAvgPool1d: "adaptive_avg_pool1d", nn.AdaptiveAvgPool2d: "adaptive_avg_pool2d",
    nn.AdaptiveAvgPool3d: "adaptive_avg_pool3d", nn.AdaptiveMaxPool1d: "adaptive_max_pool1d",
    nn.AdaptiveMaxPool2d: "adaptive_max_pool2d", nn.AdaptiveMaxPool3d: "adaptive_max_pool3d",
    nn.Upsample: "interpolate", nn.PixelShuffle: "pixel_shuffle",
    nn.PixelUnshuffle: "pixel_unshuffle", nn.Identity: "identity",
}


def module_key(module_type: type | None) -> str | None:
    """The op key of a stateless ``torch.nn`` module type (a subclass keeps its base's)."""
    if module_type is None:
        return None
    for cls in module_type.__mro__:
        key = MODULE_OPS.get(cls)
        if key is not None:
            return key
    return None
