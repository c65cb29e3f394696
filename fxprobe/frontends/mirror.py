"""The owner of "never modify the model": fxprobe's copy of the module tree, and the guard
that keeps tracing from writing model state.

:func:`mirror` makes, for each module, a new object of the same class whose ``__dict__`` holds
the original's values with its own hook tables, flags and submodule dict. Parameters and
buffers are shared *by their dicts*: the copy and the model hold the very same
``_parameters``/``_buffers`` dicts, so a conversion of either (``.double()``, ``.half()``,
``.to(device)``, which rebind buffers in those dicts) is seen by both, as if the tapped module
were the model. Registering a hook on, calling ``.eval()`` on, or swapping a submodule of the
copy does not touch the model; the model's hooks, registered or removed later, are carried
over to the copy by :class:`HookMirror`.

:func:`guard_state` is used around every trace (``tap``, ``sites``, ``extractor``,
``to_dot``): a forward that would write model state while being traced — assign a module
attribute (``self.n += 1``), write into a parameter or buffer in place, grow a list or dict held
by a module — raises :class:`TracedStateError` instead, the container is restored, and that
module runs as written. torch.fx would otherwise run the write once, at trace time, and leave it
out of the graph.
"""

from __future__ import annotations

import contextlib
import dis
import operator
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ..core.errors import TracedStateError
from ..core.ops import INPLACE_DUNDERS, inplace_name
from .wrappers import see_through

_SHARED = ("_parameters", "_buffers", "_non_persistent_buffers_set")
_OVERRIDE = "_fxprobe_override"


def mirror(model: nn.Module, *, share_state: bool = True) -> nn.Module:
    """Return a copy of ``model``'s module tree that shares every parameter and buffer.

    Args:
        model: the user's module; nothing of it changes.
        share_state: share the parameter and buffer dicts themselves (the default, for the
            tapped module). ``False`` gives the copy dicts of its own holding the same tensors,
            for private runs that replace buffers (shape propagation).
    """
    return _Copier(share_state).copy(model)


class _Children(dict):  # type: ignore[type-arg]
    """A copied module's submodule dict that counts its changes (``tapped.fc = new``,
    ``add_module``, ``del``) in a cell shared by the tapped module's tree, so that the tapped
    module sees with one comparison per forward that its graphs call modules no longer
    there (see :func:`count_changes`)."""

    def __init__(self, items: Any = (), changes: list[int] | None = None) -> None:
        super().__init__(items)
        self.changes = changes if changes is not None else [0]

    def __setitem__(self, key: str, value: Any) -> None:
        self.changes[0] += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.changes[0] += 1
        super().__delitem__(key)

    def pop(self, *args: Any) -> Any:
        self.changes[0] += 1
        return super().pop(*args)

    def popitem(self) -> Any:
        self.changes[0] += 1
        return super().popitem()

    def clear(self) -> None:
        self.changes[0] += 1
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.changes[0] += 1
        super().update(*args, **kwargs)

    def setdefault(self, key: str, default: Any = None) -> Any:
        self.changes[0] += 1
        return super().setdefault(key, default)

    def __reduce__(self) -> Any:  # pickles and deep-copies as a plain dict
        return (dict, (dict(self),))


def count_changes(root: nn.Module, cell: list[int], skip: tuple[str, ...] = ()) -> None:
    """Make the submodule dicts of ``root``'s copied tree count their changes in ``cell``, but
    below the paths in ``skip`` (torch dynamo guards on those itself, and inlines plain dicts
    only)."""
    for path, m in list(root.named_modules()):
        if any(path == p or path.startswith(p + ".") for p in skip if p) or "" in skip:
            continue
        children = m.__dict__["_modules"]
        if type(children) is dict:
            m.__dict__["_modules"] = _Children(children, cell)
        elif isinstance(children, _Children):
            children.changes = cell


def adopt(root: nn.Module) -> list[str]:
    """Replace every module placed into ``root``'s copied tree after it was made (the user's
    own object, ``tapped.fc = nn.Linear(...)``) by a copy sharing its state, so that fxprobe
    never installs anything on it; return their paths."""
    copier = _Copier(True, keep_copies=True)
    adopted = []
    for path, m in list(root.named_modules()):
        for key, child in list(m._modules.items()):
            if child is not None and not child.__dict__.get(_COPY, False):
                m._modules[key] = copier.copy(child)
                adopted.append(f"{path}.{key}" if path else key)
    return adopted


_COPY = "_fxprobe_copy"


class _Copier:
    """Copies module trees (see :func:`mirror`); ``keep_copies``: fxprobe's own copies met on
    the way stay as they are (:func:`adopt`)."""

    def __init__(self, share_state: bool, keep_copies: bool = False) -> None:
        self.share_state = share_state
        self.keep_copies = keep_copies
        self.memo: dict[int, nn.Module] = {}

    def copy(self, m: nn.Module) -> nn.Module:
        memo, share_state = self.memo, self.share_state
        if id(m) in memo:  # a module registered under two names stays one module
            return memo[id(m)]
        if self.keep_copies and m.__dict__.get(_COPY, False):
            return m
        c = object.__new__(type(m))
        memo[id(m)] = c
        state = dict(m.__dict__)
        for key, value in state.items():
            if share_state and key in _SHARED:
                continue
            # Own containers (hooks, flags) so that changes to the copy stay there.
            if isinstance(value, dict):
                state[key] = type(value)(value) if type(value) is not dict else dict(value)
            elif isinstance(value, set):
                state[key] = set(value)
            elif isinstance(value, types.MethodType) and value.__self__ is m:
                # A method bound to the model (a patched forward, accelerate's _old_forward)
                # runs on the copy, so that the copy's children are the ones it calls.
                state[key] = types.MethodType(value.__func__, c)
        see_through(m, c, state)  # a wrapper installed as the forward runs on the copy
        state["_modules"] = {
            k: (self.copy(v) if v is not None else None) for k, v in m._modules.items()}
        state[_COPY] = True
        c.__dict__.update(state)
        return c


def own_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward the model runs for ``module``: a patched instance forward, else the class's."""
    patched = module.__dict__.get("forward")
    if patched is not None and not getattr(patched, _OVERRIDE, False):
        return patched  # type: ignore[no-any-return]
    return types.MethodType(type(module).forward, module)


def has_patched_forward(module: nn.Module) -> bool:
    """Whether the user (or a library such as accelerate) replaced ``forward`` on the instance."""
    patched = module.__dict__.get("forward")
    return patched is not None and not getattr(patched, _OVERRIDE, False)


def install_override(module: nn.Module, forward: Callable[..., Any]) -> None:
    """Make ``forward`` the copy's forward (fxprobe's dispatcher for a traced region)."""
    setattr(forward, _OVERRIDE, True)
    object.__setattr__(module, "forward", forward)


def drop_overrides(root: nn.Module) -> None:
    """Remove the forwards fxprobe installed on copied modules; patched user forwards stay."""
    for m in root.modules():
        if getattr(m.__dict__.get("forward"), _OVERRIDE, False):
            del m.__dict__["forward"]


_FXPROBE_HOOK = "_fxprobe_hook"
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_HOOK_FLAGS = {"_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
               "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")}
"""The per-hook flag dicts torch keeps beside a hook table, by table."""
_LIBRARY_HOOKS = frozenset({"transformers.utils.output_capturing", "transformers.utils.generic"})
"""Modules whose functions are hooks a library installs on a model as it runs it:
transformers' output capturing (``output_hidden_states=True``, ``OutputRecorder``) installs
them on the modules of the model it runs, at the first call that asks for them."""


def fxprobe_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a hook as fxprobe's own: :func:`user_hooks` and :class:`HookWatch` ignore it."""
    setattr(fn, _FXPROBE_HOOK, True)
    return fn


def library_hook(fn: Any) -> bool:
    """Whether ``fn`` is a hook a library installs on the model it runs (see
    ``_LIBRARY_HOOKS``): the tapped module's copy gets its own when it runs, unannounced."""
    return getattr(fn, "__module__", None) in _LIBRARY_HOOKS


def user_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has hooks that are not fxprobe's (forward, pre-forward, backward)."""
    return any(_hook_keys(module))  # a table with a hook not fxprobe's is a non-empty tuple


def _hook_keys(module: nn.Module, library: bool = True) -> tuple[tuple[int, ...], ...]:
    """The keys of ``module``'s hooks not fxprobe's, per table (``library``: libraries' too)."""
    return tuple(tuple(k for k, fn in getattr(module, table).items()
                       if not getattr(fn, _FXPROBE_HOOK, False)
                       and (library or not library_hook(fn))) for table in _HOOK_TABLES)


GLOBAL_HOOKS = "every module (torch.nn.modules.module.register_module_forward_hook and kin)"
"""What :meth:`HookWatch.changed` names when the global module hooks changed."""
_GLOBAL_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks",
                  "_global_backward_pre_hooks", "_global_backward_hooks")


def global_keys() -> tuple[tuple[int, ...], ...]:
    """The keys of the hooks every module runs (``register_module_forward_hook`` and kin), per
    table: any non-empty where one is set."""
    return tuple(tuple(getattr(torch.nn.modules.module, t)) for t in _GLOBAL_TABLES)


def any_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has a hook in one of its tables, fxprobe's and libraries' included
    (the one look most modules cost: ``_HOOK_TABLES`` spelled out, 4x faster than a loop)."""
    d = module.__dict__
    return bool(d["_forward_pre_hooks"] or d["_forward_hooks"] or d["_backward_pre_hooks"]
                or d["_backward_hooks"])


class Registrations:
    """Whether a hook was registered anywhere in the process since the last look, in one
    comparison: every registration (modules and tensors alike) draws a number from
    ``RemovableHandle.next_id``; a removal draws none. ``seen=False``: the registrations
    so far count as unseen (the first look says moved)."""

    def __init__(self, seen: bool = True) -> None:
        self.epoch = RemovableHandle.next_id if seen else -1

    def moved(self) -> bool:
        """Whether a hook was registered since the last look (which this one now is)."""
        now = RemovableHandle.next_id
        if now == self.epoch:
            return False
        self.epoch = now
        return True


class HookWatch:
    """Notices a hook registered on (or removed from) a module whose forward a graph inlined,
    where the graph would never run it.

    While no hook was registered anywhere (:class:`Registrations`), the check is one
    comparison. When one was, the watched modules are looked at: a module the fx frontend
    inlined had no hooks when traced (a hooked module is a region boundary, see ``_trace``),
    so any hook on it now is new. A module under torch dynamo may have been captured with its
    hooks; those few are compared with their hook tables at every check, since removing a hook
    draws no number."""

    def __init__(self, modules: dict[str, nn.Module], fresh: bool = False) -> None:
        self.modules = modules
        self.hooked = {path: _hook_keys(m) for path, m in modules.items() if user_hooks(m)}
        self.users = {path: _hook_keys(modules[path], library=False) for path in self.hooked}
        self.registrations = Registrations(seen=not fresh)  # fresh: the first check looks
        self.globals = global_keys()  # at every module
        if fresh:  # graphs built after the trace: a user's hook there now is new to them
            self.hooked = {p: k for p, k in self.hooked.items() if not any(self.users[p])}
            self.users = {p: self.users[p] for p in self.hooked}

    def changed(self) -> list[str]:
        """The paths of the watched modules whose hooks changed (empty: none did);
        :data:`GLOBAL_HOOKS` where the hooks every module runs changed."""
        out = [p for p, keys in self.hooked.items() if _hook_keys(self.modules[p]) != keys
               ] if self.hooked else []
        moved = self.registrations.moved()
        if (any(self.globals) or moved) and global_keys() != self.globals:  # a removal
            self.globals = global_keys()  # draws no number
            out.append(GLOBAL_HOOKS)
        if not moved:
            return out
        for path, m in self.modules.items():
            if path not in self.hooked and any_hooks(m) and user_hooks(m):
                out.append(path)
        return out

    def by_user(self, paths: list[str]) -> list[str]:
        """Those of ``paths`` (:meth:`changed`) where hooks other than libraries' changed."""
        empty = ((),) * len(_HOOK_TABLES)
        return [p for p in paths if p == GLOBAL_HOOKS or p in self.modules and
                _hook_keys(self.modules[p], library=False) != self.users.get(p, empty)]


def _same_change(model: nn.Module, copy: nn.Module,
                 children: tuple[tuple[str, nn.Module | None], ...]) -> bool:
    """Whether every child of ``model`` that is no longer the one it had at ``tap()``
    (``children``) was given to its copy too: the same module under the same name (or
    fxprobe's copy of it, :func:`adopt`, which shares its parameter dict), or deleted from
    both."""
    was, now, mine = dict(children), model._modules, copy._modules

    def same(a: nn.Module | None, b: nn.Module | None) -> bool:
        return a is b or (a is not None and b is not None and b.__dict__.get(_COPY, False)
                          and a.__dict__["_parameters"] is b.__dict__["_parameters"])

    return all(same(now.get(k), mine.get(k)) and (k in now) == (k in mine)
               for k in set(was) | set(now) if now.get(k) is not was.get(k) or k not in now)


_NOT_ATTRIBUTES = frozenset({"training", "_modules", "_parameters", "_buffers",
                             "_non_persistent_buffers_set", "_compiled_call_impl"})
"""A module's ``__dict__`` keys :meth:`HookMirror.replaced` does not compare: the mode
(:meth:`HookMirror.modes_changed`), the containers (shared with the copy, or compared by
their contents), ``Module.compile()``'s entry (the same values); hook tables are followed."""


_WRITTEN: dict[type, frozenset[str]] = {}


def written_by_forward(cls: type[nn.Module]) -> frozenset[str]:
    """The attribute names ``cls``'s ``forward`` stores (``self.max_seq_len_cached = n`` in
    transformers' dynamic RoPE): state the forward keeps for itself, which the model's own
    calls change and the copy's calls change on the copy, so no change of the user's. Read
    from the bytecode of ``forward``, of what it wraps (``__wrapped__``, closures), of the
    functions nested in those, and of the methods of ``cls`` it names, a few levels deep."""
    names: set[str] = set()
    seen: set[int] = set()

    def scan(code: types.CodeType, depth: int) -> None:
        if id(code) in seen:
            return
        seen.add(id(code))
        for ins in dis.get_instructions(code):
            if ins.opname == "STORE_ATTR":
                names.add(ins.argval)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                scan(const, depth)
        if depth < 3:
            for name in code.co_names:  # self.method(...): the methods of cls it names
                method = getattr(cls, name, None)
                if (isinstance(method, types.FunctionType) and name != "__init__"
                        and getattr(nn.Module, name, None) is not method):
                    walk(method, depth + 1)

    def walk(fn: Any, depth: int) -> None:
        code = getattr(fn, "__code__", None)
        if not isinstance(code, types.CodeType) or depth > 3:
            return
        scan(code, depth)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(inner, types.FunctionType):
                walk(inner, depth + 1)
        walk(getattr(fn, "__wrapped__", None), depth + 1)

    if cls in _WRITTEN:
        return _WRITTEN[cls]
    if cls.forward is not nn.Module.forward:
        walk(cls.forward, 0)
    _WRITTEN[cls] = frozenset(names)
    return _WRITTEN[cls]


def _compared(m: nn.Module) -> tuple[str, ...]:
    """The keys of ``m.__dict__`` :meth:`HookMirror.replaced` compares: not
    :data:`_NOT_ATTRIBUTES`, nor hook tables and their bookkeeping (``_is_full_backward_hook``,
    followed by :meth:`HookMirror.sync`), nor a ``forward`` that is the class's own bound to
    ``m`` (what accelerate's ``remove_hook_from_module`` puts back: it runs as none does),
    nor the state its forward keeps for itself (:func:`written_by_forward`)."""
    d = m.__dict__
    forward = d.get("forward")
    own = (isinstance(forward, types.MethodType) and forward.__self__ is m
           and forward.__func__ is getattr(type(m), "forward", None))
    kept = written_by_forward(type(m))
    return tuple(k for k in d if k not in _NOT_ATTRIBUTES and "hook" not in k
                 and k not in kept and not (own and k == "forward"))


def _attributes(m: nn.Module) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """``m``'s compared attributes (:func:`_compared`): their keys and their values now."""
    keys = _compared(m)
    d = m.__dict__
    return keys, tuple(d[k] for k in keys)


def _followed(k: str, old: Any, d: dict[str, Any], copy: dict[str, Any],
              kept: set[tuple[int, str]]) -> bool:
    """Whether the attribute ``k`` of a model module (its ``__dict__`` ``d``) still holds
    ``old``, or a value the copy (its ``__dict__`` ``copy``) follows: an equal one, which the
    copy then holds too (``torch.export`` and other tools put attributes back as equal new
    objects; never a ``forward``, a callable or a module, bound to the model, not the copy);
    or state the module's forward keeps for itself, known by the copy's value having changed
    too (its own calls set it: dynamic RoPE's ``max_seq_len_cached``), which each keeps on its
    own from then on (``kept``)."""
    new = d[k]
    if new is old:
        return True
    if (id(copy), k) in kept or (copy.get(k, old) is not old and k != "forward"
                                 and not callable(new)):
        kept.add((id(copy), k))
        return True
    if k == "forward" or callable(new) or not _equal(old, new):
        return False
    if copy.get(k) is old:
        copy[k] = new  # equal: the copy holds the model's object, as at tap()
    return True


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` for attribute values, where it is a plain yes (tensors by ``torch.equal``;
    anything that cannot say is unequal)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                and bool(torch.equal(a, b)))
    try:
        same = a == b
    except Exception:
        return False
    return same is True


def _changes(path: str, m: nn.Module, c: nn.Module, keys: tuple[str, ...],
             values: tuple[Any, ...], children: tuple[tuple[str, nn.Module | None], ...],
             cls: type, kept: set[tuple[int, str]]) -> list[str]:
    """What changed on the model's module ``m`` (at ``path``) since its snapshot
    (:meth:`HookMirror._snapshot`: class, compared attributes ``keys`` holding ``values``,
    ``children``) that its copy ``c`` does not follow (:func:`_followed`,
    :func:`_same_change`); empty where nothing did."""
    if type(m) is not cls:
        return [f"its class ({cls.__name__} at tap(), {type(m).__name__} now)"]
    d = m.__dict__
    out = set(_compared(m)).symmetric_difference(keys)  # set or deleted
    out.update(k for k, v in zip(keys, values, strict=True)
               if k in d and k not in out and not _followed(k, v, d, c.__dict__, kept))
    found = sorted(out)
    if tuple(m._modules.items()) != children and not _same_change(m, c, children):
        found.append("its submodules")
    return found


class ModeChangedWarning(UserWarning):
    """A module of the model was put in train or eval mode after ``tap()`` and the tapped
    module's copy of it is in the other: the tapped module keeps its own mode."""


class HookMirror:
    """Keeps the hook tables of fxprobe's copy of the model's modules as the user last set them
    on the model: a hook registered on a module of the model after ``tap()`` is put on its
    copy, one removed from it is taken off the copy (the copy has tables of its own, so that
    hooks registered on the tapped module stay off the model). Libraries' own hooks
    (:func:`library_hook`) are left out: the copy gets its own when it runs.

    Args:
        pairs: ``(path, the model's module, its copy)``.
    """

    def __init__(self, pairs: list[tuple[str, nn.Module, nn.Module]]) -> None:
        self.pairs = pairs
        self.synced = {path: _hook_keys(m, library=False) for path, m, _ in pairs}
        self.hooked = {p: (p, m, c) for p, m, c in pairs if any(self.synced[p])}
        """The pairs whose model module had hooks at the last sync."""
        self.registrations = Registrations()
        self.modes = [m.training for _, m, _ in pairs]
        """Each model module's ``training`` flag as last seen (see :meth:`modes_changed`)."""
        self.changes: dict[str, list[str]] = {}
        """What :meth:`replaced` last found changed, by path (:meth:`what_changed`)."""
        self.kept: set[tuple[int, str]] = set()
        """``(id of a copy, attribute)``: state that module's forward keeps for itself, seen
        changed on the copy too (:func:`_followed`)."""
        self._snapshot()

    def _snapshot(self) -> None:
        """What :meth:`replaced` compares against, taken from the model as it is now."""
        pairs = self.pairs
        self.tree = [(path, m, c, *_attributes(m), tuple(m._modules.items()))
                     for path, m, c in pairs]
        """Each model module's copy, attributes (their keys, their values) and children as at
        ``tap()`` (or as last followed): the copy runs those (see :meth:`replaced`)."""
        # The same, flat, for one pass in C over every module (:meth:`replaced`'s fast path).
        dicts = [m.__dict__ for _, m, _ in pairs]
        subs = [m._modules for _, m, _ in pairs]
        self._sizes = (dicts, [len(d) for d in dicts], subs, [len(d) for d in subs])
        self._model_modules = [m for _, m, _ in pairs]
        self._classes = list(map(type, self._model_modules))
        self._flat = tuple(
            (holders, keys, [h[k] for h, k in zip(holders, keys, strict=True)])
            for holders, keys in (
                ([d for (*_, keys, _, _), d in zip(self.tree, dicts, strict=True)
                  for _ in keys],
                 [k for *_, keys, _, _ in self.tree for k in keys]),
                ([d for d in subs for _ in d], [k for d in subs for k in d])))

    def replaced(self) -> list[str]:
        """The paths of the model's modules whose attributes were set, replaced or deleted
        since ``tap()`` (a ``forward`` wrapper installed or removed, ``self.scaling = 2.0``,
        an adapter switched), or whose submodules were assigned, added or deleted where the
        copy did not get the same change (a submodule assigned to both the model and the
        tapped module is followed). The copy keeps running the module tree, forwards and
        attributes the model had at ``tap()`` (``frontends.wrappers``; attributes are shared
        by value, so a list or config changed in place is seen; one put back as an equal
        object, as ``torch.export`` does, is taken by the copy): such a change is not
        followed (hooks are, by :meth:`sync`; weights too, being shared). Where nothing
        changed, one pass in C over every module's ``__dict__`` size and attributes, by
        identity (about 0.2 ms at 1047 modules on CPU); else module by module."""
        dicts, sizes, subs, counts = self._sizes
        classes = self._classes
        try:
            if (list(map(len, dicts)) == sizes and list(map(len, subs)) == counts
                    and list(map(type, self._model_modules)) == classes
                    and all(all(map(operator.is_, map(dict.__getitem__, holders, keys), values))
                            for holders, keys, values in self._flat)):
                return []  # nothing changed: no Python loop over the modules
        except KeyError:  # a key deleted and another added
            pass
        # Something changed, or only keys not compared: module by module.
        self.changes = {}
        for entry, cls in zip(self.tree, classes, strict=True):
            found = _changes(*entry, cls, self.kept)
            if found:
                self.changes[entry[0]] = found
        if not self.changes:  # only keys not compared (a hook's bookkeeping) were added or
            # deleted, or values rebound to equal ones (followed): the fast path again, from
            # now. (A compared key added while another not compared is deleted, between two
            # calls, keeps the sizes: missed.)
            self._snapshot()
        return list(self.changes)

    def what_changed(self, path: str) -> list[str]:
        """What :meth:`replaced` last found changed on the model's module at ``path`` (its
        class, attributes such as ``forward`` or ``scaling``, its submodules), for a message."""
        return self.changes.get(path, [])

    def modes_changed(self) -> list[str]:
        """The paths of the model's modules whose ``training`` flag changed since last asked
        (``model.eval()`` after ``tap()``) and now differs from their copy's. The tapped module
        keeps a mode of its own (``tapped.train()``/``.eval()``, which leave the model's flag
        alone), so the model's change is not followed: it is said
        (:class:`ModeChangedWarning`), once per change."""
        now = [m.training for _, m, _ in self.pairs]
        if now == self.modes:
            return []
        old, self.modes = self.modes, now
        return [path for (path, m, c), was in zip(self.pairs, old, strict=True)
                if m.training != was and m.training != c.training]

    def sync(self) -> list[str]:
        """Bring the copies' tables in line with the model's; return the paths that changed.
        One comparison per module with hooks (a removal draws no number), all modules only
        once a hook was registered somewhere in the process."""
        scan = self.registrations.moved()
        if not scan and not self.hooked:
            return []
        out = []
        for path, m, c in self.pairs if scan else list(self.hooked.values()):
            if path not in self.hooked and not any_hooks(m):
                continue  # no hook before, none now: the one look most modules cost
            keys = _hook_keys(m, library=False)
            old = self.synced[path]
            if keys == old:
                continue
            for table, now, before in zip(_HOOK_TABLES, keys, old, strict=True):
                _sync_table(m, c, table, now, before)
            self.synced[path] = keys
            if any(keys):
                self.hooked[path] = (path, m, c)
            else:
                self.hooked.pop(path, None)
            out.append(path)
        return out


def _sync_table(m: nn.Module, c: nn.Module, table: str, now: tuple[int, ...],
                before: tuple[int, ...]) -> None:
    """Make the hooks of ``c``'s ``table`` that came from ``m`` (``before``) those ``m`` has now
    (``now``), with the flags torch keeps beside them."""
    mine, theirs = getattr(c, table), getattr(m, table)
    flags = _HOOK_FLAGS.get(table, ())
    for k in set(before) - set(now):
        mine.pop(k, None)
        for f in flags:
            getattr(c, f).pop(k, None)
    for k in now:
        if k not in before:
            mine[k] = theirs[k]
            for f in flags:
                if k in getattr(m, f):
                    getattr(c, f)[k] = getattr(m, f)[k]
    # In the model's order (``prepend=True`` puts a hook first): the copy's own hooks that ran
    # before all of the model's stay first, the others after them, fxprobe's last (a site
    # is what the call returns, or what the forward receives, as when set before tap()).
    ours, keys = set(now), list(mine)
    first = next((i for i, k in enumerate(keys) if k in ours), len(keys))
    late = [k for k in keys if getattr(mine[k], _FXPROBE_HOOK, False)]
    for k in [*now, *(k for k in keys[first:] if k not in ours and k not in late), *late]:
        mine.move_to_end(k)
    if table == "_backward_hooks":  # full or not: one setting per module
        c.__dict__["_is_full_backward_hook"] = m.__dict__.get("_is_full_backward_hook")


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None
    return ptr or None


class _TensorWriteGuard(TorchFunctionMode):
    """Refuse in-place writes into the model's parameters and buffers."""

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
        if (inplace_name(name) or name in INPLACE_DUNDERS
                or kwargs.get("inplace") is True) and args:
            targets.append(args[0])
        if kwargs.get("out") is not None:
            targets.append(kwargs["out"])
        for t in targets:
            owner = self.owned.get(_storage_ptr(t) or -1) if isinstance(t, torch.Tensor) else None
            if owner is not None:
                raise TracedStateError(
                    f"the forward writes in place into the model's tensor {owner!r} "
                    f"({name}), which torch.fx cannot record"
                )
        return func(*args, **kwargs)


def _containers(root: nn.Module) -> list[tuple[str, str, Any, Any]]:
    """(module path, attribute, container, shallow copy) of every list, dict and set that a
    module holds as plain state."""
    found = []
    for path, m in root.named_modules(remove_duplicate=True):
        for key, value in vars(m).items():
            if not key.startswith("_") and type(value) in (list, dict, set):
                found.append((path, key, value, value.copy()))
    return found


def _restore(container: Any, saved: Any) -> None:
    if isinstance(container, list):
        container[:] = saved
    else:
        container.clear()
        container.update(saved)


def _changed(container: Any, saved: Any) -> bool:
    if len(container) != len(saved):
        return True
    if isinstance(container, list):
        return any(a is not b for a, b in zip(container, saved, strict=True))
    if isinstance(container, dict):
        return any(container.get(k, saved) is not v for k, v in saved.items())
    return container != saved


@contextlib.contextmanager
def guard_state(root: nn.Module, where: Callable[[nn.Module], str | None]) -> Iterator[None]:
    """While tracing ``root``, refuse every write of model state (see the module docstring).

    Args:
        root: the copy being traced.
        where: the qualified path of a module of the tree, or None for a module outside it
            (one the forward builds on the fly may set its own attributes).

    Raises:
        TracedStateError: from inside the forward (attribute stores, tensor writes), or when
            the trace ends, for a container that grew or shrank (after restoring it).
    """
    members = {id(m) for m in root.modules()}
    original = nn.Module.__setattr__

    def guarded(module: nn.Module, name: str, value: Any) -> None:
        if id(module) in members:
            path = where(module)
            shown = f"{path}.{name}" if path else name
            what = "a traced value" if isinstance(value, fx.Proxy) else "a value"
            raise TracedStateError(
                f"the forward stores {what} in {shown!r} (self.{name} = ...): module state "
                "that torch.fx cannot record"
            )
        original(module, name, value)

    snapshot = _containers(root)
    nn.Module.__setattr__ = guarded  # type: ignore[method-assign,assignment]
    failed = False
    try:
        with _TensorWriteGuard(root):
            yield
    except BaseException:
        failed = True
        raise
    finally:
        nn.Module.__setattr__ = original  # type: ignore[method-assign]
        touched = [(path, key, c) for path, key, c, saved in snapshot if _changed(c, saved)]
        for _, _, c, saved in snapshot:
            _restore(c, saved)
        if touched and not failed:
            path, key, c = touched[0]
            error = TracedStateError(
                f"the forward changes self.{key} (a {type(c).__name__} held by "
                f"{path or 'the module'!r}): Python state that torch.fx cannot record"
            )
            error.module_path = path
            raise error
