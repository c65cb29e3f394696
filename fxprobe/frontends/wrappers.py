"""Forwards replaced on the instance, seen through on fxprobe's copy of the module tree.

A library or a user may replace ``module.forward`` with a wrapper: accelerate
(``device_map=``, ``dispatch_model``, ``cpu_offload``) installs
``functools.partial(new_forward, module)`` and keeps the class forward in
``module._old_forward``; others install a closure over the module or a bound method. Copied as
it is, such a wrapper still holds the *model's* module, so the copy would run the model's own
submodules, on which fxprobe installs nothing: every site inside would be lost without a word.

:func:`see_through` is called by :func:`~fxprobe.frontends.mirror.mirror` for every copied
module whose ``forward`` is an instance attribute:

- an accelerate wrapper (``_hf_hook``, ``_old_forward``) becomes the class forward (which every
  tracer reaches at op level) with the hook's ``pre_forward`` and ``post_forward`` as forward
  hooks of the copy, so that they still run (they move inputs and load offloaded weights)
  around whatever fxprobe runs for the module, exactly as ``new_forward`` runs them;
- a partial, closure or bound method that holds the module (or its own ``forward``) is
  rebuilt holding the copy instead: it runs as written, on the copy's submodules;
- a wrapper that reaches the module in a way fxprobe cannot rebuild (an object holding it)
  keeps running the model's own submodules: a warning names the module.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


class WrappedForwardWarning(UserWarning):
    """A module's ``forward`` wrapper runs the model's own submodules, out of fxprobe's reach."""


class ModelChangedWarning(UserWarning):
    """A module of the model had its ``forward`` replaced or its submodules changed after
    ``tap()``: the tapped module runs the module tree and forwards as they were at ``tap()``."""


def see_through(original: nn.Module, copy: nn.Module, state: dict[str, Any]) -> None:
    """Make the copy's ``state`` (its ``__dict__`` to be) run on the copy; see the module
    docstring. Nothing of ``original`` changes."""
    forward = state.get("forward")
    if forward is None:
        return
    hook = state.get("_hf_hook")
    old = state.get("_old_forward")
    if (hook is not None and isinstance(forward, functools.partial)
            and forward.args[:1] == (original,) and not getattr(hook, "no_grad", False)
            and isinstance(old, types.MethodType) and old.__self__ is copy):
        _accelerate_as_hooks(copy, state, old)
        return
    rebuilt = _rebind(forward, original, copy, depth=0)
    if rebuilt is not forward:
        state["forward"] = rebuilt
        return
    if _reaches(forward, original):
        warnings.warn(
            f"{type(original).__name__}.forward was replaced on the instance by "
            f"{_describe(forward)}, which holds the module in a way fxprobe cannot rebind to "
            "its copy: it runs the model's own submodules, so no site inside this module is "
            "reached (only its call). Wrap the forward in a functools.partial or a closure over "
            "the module, or remove the wrapper before fxprobe.tap.",
            WrappedForwardWarning, stacklevel=4)


def _accelerate_as_hooks(copy: nn.Module, state: dict[str, Any],
                         old: types.MethodType) -> None:
    """``new_forward`` of accelerate, said as forward hooks of the copy around ``old``."""
    if old.__func__ is getattr(type(copy), "forward", None):
        del state["forward"]  # the class forward: fx and dynamo reach its ops
    else:
        state["forward"] = old  # a forward patched before accelerate's: runs as written

    # Hook ids from torch's own counter, so that they never collide with later ones.
    pre_id, post_id = (RemovableHandle(collections.OrderedDict()).id for _ in range(2))
    inputs: dict[int, Any] = {}  # the input device an io_same_device hook returns to
    hooks = _align_hooks(state["_hf_hook"])
    # What the traced moves need, read now: dynamo does not read the hook objects' attributes.
    spec = None if hooks is None else [
        (i, h.io_same_device, h.execution_device, _keys(h.skip_keys)) for i, h in enumerate(hooks)]

    def pre(module: nn.Module, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not torch.compiler.is_compiling() or spec is None:
            args, kwargs = _hook(module).pre_forward(module, *args, **kwargs)
            return tuple(args), dict(kwargs)
        # Traced by dynamo: accelerate's hook is compiler-disabled (a graph break would split
        # the module's graph and lose its names), so its device moves are traced here and the
        # offloaded weights are loaded around the whole dynamo region (:func:`weights_loaded`).
        for i, same, device, skip in spec:
            if same:
                inputs[i] = _device_of((args, kwargs))
            args = _to(args, device, ())
            kwargs = _to(kwargs, device, skip)
        return tuple(args), dict(kwargs)

    def post(module: nn.Module, args: Any, output: Any) -> Any:
        if not torch.compiler.is_compiling() or spec is None:
            return _hook(module).post_forward(module, output)
        for i, same, _, skip in reversed(spec):
            device = inputs.get(i)
            if same and device is not None:
                output = _to(output, device, skip)
        return output

    # The copy's hook tables are already its own (mirror copied them): nothing reaches the
    # model. Inside new_forward: after every hook the model has before its forward, and
    # before every hook it has after it.
    state["_forward_pre_hooks"][pre_id] = pre
    state["_forward_pre_hooks_with_kwargs"][pre_id] = True
    after = state["_forward_hooks"]
    after[post_id] = post
    after.move_to_end(post_id, last=False)


def _hook(module: nn.Module) -> Any:
    return module.__dict__["_hf_hook"]


def _align_hooks(hook: Any) -> list[Any] | None:
    """The AlignDevicesHooks ``hook`` is made of (a SequentialHook chains them); ``None`` where
    it has another kind of hook, which dynamo then meets as written."""
    try:
        from accelerate.hooks import AlignDevicesHook, SequentialHook
    except ImportError:
        return None
    parts = list(hook.hooks) if isinstance(hook, SequentialHook) else [hook]
    return parts if all(type(h) is AlignDevicesHook for h in parts) else None


def _keys(skip: Any) -> tuple[str, ...]:
    return () if skip is None else (skip,) if isinstance(skip, str) else tuple(skip)


def _to(value: Any, device: Any, skip: tuple[str, ...]) -> Any:
    """accelerate's ``send_to_device`` for what dynamo traces: tensors in tuples, lists and
    dicts (``skip``: keys left where they are)."""
    if device is None:
        return value
    if isinstance(value, torch.Tensor):  # no op where it is there (dynamo knows devices)
        return value if value.device == torch.device(device) else value.to(device)
    if isinstance(value, dict):
        return type(value)({k: v if k in skip else _to(v, device, skip) for k, v in value.items()})
    if isinstance(value, (tuple, list)):
        moved = [_to(v, device, skip) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)
    return value


def _device_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.device
    items = value.values() if isinstance(value, dict) else value if isinstance(
        value, (tuple, list)) else ()
    for v in items:
        device = _device_of(v)
        if device is not None:
            return device
    return None


def offloaded(module: nn.Module) -> list[tuple[nn.Module, Any]]:
    """The modules of ``module``'s tree whose weights accelerate offloads (``offload=True``),
    each with its hook; empty for a model accelerate did not dispatch."""
    return [(m, h) for m in module.modules()
            for h in (_align_hooks(m.__dict__.get("_hf_hook")) or ()) if h.offload]


@contextlib.contextmanager
def weights_loaded(pairs: list[tuple[nn.Module, Any]]) -> Iterator[None]:
    """Load the weights of :func:`offloaded` ``pairs`` for the duration of a dynamo region's
    run, and offload them again after it: a captured graph reads every weight when it starts."""
    done = []
    try:
        for m, h in pairs:
            kept = getattr(h, "input_device", None)  # io_same_device: the call's, not ours
            h.pre_forward(m)
            h.input_device = kept
            done.append((m, h))
        yield
    finally:
        for m, h in reversed(done):
            h.post_forward(m, None)


def _rebind(fn: Any, original: nn.Module, copy: nn.Module, depth: int) -> Any:
    """``fn`` holding ``copy`` where it held ``original`` (or ``original``'s bound methods);
    ``fn`` itself where it holds neither or cannot be rebuilt."""
    if depth > 4:
        return fn
    if fn is original:
        return copy
    if isinstance(fn, types.MethodType):
        if fn.__self__ is original:
            return types.MethodType(fn.__func__, copy)
        func = _rebind(fn.__func__, original, copy, depth + 1)
        return fn if func is fn.__func__ else types.MethodType(func, fn.__self__)
    if isinstance(fn, functools.partial):
        args = tuple(_rebind(a, original, copy, depth + 1) for a in fn.args)
        kw = {k: _rebind(v, original, copy, depth + 1) for k, v in fn.keywords.items()}
        func = _rebind(fn.func, original, copy, depth + 1)
        if (func is fn.func and all(a is b for a, b in zip(args, fn.args, strict=True))
                and all(kw[k] is v for k, v in fn.keywords.items())):
            return fn
        new = functools.partial(func, *args, **kw)
        new.__dict__.update(fn.__dict__)
        wrapped = new.__dict__.get("__wrapped__")
        if wrapped is not None:
            new.__dict__["__wrapped__"] = _rebind(wrapped, original, copy, depth + 1)
        return new
    if isinstance(fn, types.FunctionType) and fn.__closure__:
        cells = []
        changed = False
        for cell in fn.__closure__:
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                cells.append(cell)
                continue
            new_value = _rebind(value, original, copy, depth + 1)
            changed |= new_value is not value
            cells.append(types.CellType(new_value) if new_value is not value else cell)
        if not changed:
            return fn
        new_fn = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                    tuple(cells))
        new_fn.__kwdefaults__ = fn.__kwdefaults__
        new_fn.__dict__.update(fn.__dict__)
        new_fn.__qualname__ = fn.__qualname__
        return new_fn
    return fn


def _reaches(fn: Any, original: nn.Module) -> bool:
    """Whether ``fn`` holds ``original`` somewhere that :func:`_rebind` does not rebuild (an
    object's attributes, a container), looked for a few levels deep."""
    seen: set[int] = set()

    def holds(value: Any, depth: int) -> bool:
        if value is original:
            return True
        if depth > 3 or id(value) in seen or isinstance(value, (torch.Tensor, type)):
            return False
        seen.add(id(value))
        if isinstance(value, types.MethodType):
            return holds(value.__self__, depth + 1) or holds(value.__func__, depth + 1)
        if isinstance(value, functools.partial):
            return any(holds(v, depth + 1)
                       for v in (value.func, *value.args, *value.keywords.values()))
        if isinstance(value, types.FunctionType):
            return any(holds(c.cell_contents, depth + 1) for c in value.__closure__ or ()
                       if _full(c))
        if isinstance(value, (list, tuple, set, frozenset)):
            return any(holds(v, depth + 1) for v in value)
        if isinstance(value, dict):
            return any(holds(v, depth + 1) for v in value.values())
        if isinstance(value, nn.Module):
            return False  # another module: it is copied and runs as its copy
        d = getattr(value, "__dict__", None)
        return isinstance(d, dict) and any(holds(v, depth + 1) for v in d.values())

    return holds(fn, 0)


def _full(cell: Any) -> bool:
    try:
        return cell.cell_contents is not cell
    except ValueError:  # an empty cell
        return False


def _describe(fn: Callable[..., Any]) -> str:
    if isinstance(fn, types.MethodType):
        return f"a method of {type(fn.__self__).__name__} ({fn.__func__.__qualname__})"
    return f"{type(fn).__name__} {getattr(fn, '__qualname__', repr(fn))}"


def placement(root: nn.Module) -> dict[str, str]:
    """Where accelerate runs each dispatched module of ``root``'s tree, by module path: its
    execution device, and where its weights are kept between forwards when offloaded
    (``"cpu (weights offloaded to disk)"``). Empty for a model accelerate did not dispatch."""
    out = {}
    for path, m in root.named_modules():
        hooks = _align_hooks(m.__dict__.get("_hf_hook"))
        devices = [h for h in hooks or () if h.execution_device is not None]
        if not devices:
            continue
        where = str(torch.device(devices[-1].execution_device))
        kept = {_kept(h.weights_map, name) for h in hooks or () if h.offload
                for name, _ in m.named_parameters(recurse=h.place_submodules)}
        out[path] = (f"{where} (weights offloaded to {' and '.join(sorted(kept))})" if kept
                     else where)
    return out


def _kept(weights: Any, name: str) -> str:
    """``"disk"`` or ``"cpu"``: where accelerate keeps the offloaded weight ``name``."""
    prefix = ""
    while hasattr(weights, "dataset") and hasattr(weights, "prefix"):  # a PrefixedDataset
        prefix, weights = prefix + weights.prefix, weights.dataset
    index = getattr(weights, "index", None)
    in_memory = getattr(weights, "state_dict", {})
    return "disk" if isinstance(index, dict) and prefix + name in index and (
        prefix + name not in in_memory) else "cpu"


def site_devices(sites: Any, root: nn.Module) -> dict[str, str]:
    """For each site (by name and canonical name), where its value is computed: the
    :func:`placement` of the innermost dispatched module that holds it; empty for a model
    accelerate did not dispatch."""
    where = placement(root)
    if not where:
        return {}
    out = {}
    for s in sites:
        path = s.module_path or ""
        while path not in where and path:
            path = path.rpartition(".")[0]
        if path in where:  # by site name and by canonical name
            out.update(dict.fromkeys((s.name, *s.canonical), where[path]))
    return out
