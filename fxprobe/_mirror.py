"""Shallow copies of a model's modules, so that tapping never touches the user's objects.

Each copy is a new object of the same class whose ``__dict__`` holds the original's values, with
its own dicts (submodules, parameters, buffers, hooks) that point at the same tensors. Training the
copy trains the model; registering a hook on, or calling ``.eval()`` on, the copy does not.
"""

from __future__ import annotations

from torch import nn


def mirror(model: nn.Module) -> nn.Module:
    """Return a copy of ``model``'s module tree that shares every parameter and buffer."""
    memo: dict[int, nn.Module] = {}

    def copy_module(m: nn.Module) -> nn.Module:
        if id(m) in memo:  # a module registered under two names stays one module
            return memo[id(m)]
        c = object.__new__(type(m))
        memo[id(m)] = c
        state = dict(m.__dict__)
        for key, value in state.items():
            # Own containers (hooks, parameters, flags) so that changes to the copy stay there.
            if isinstance(value, dict):
                state[key] = type(value)(value) if type(value) is not dict else dict(value)
            elif isinstance(value, set):
                state[key] = set(value)
        state["_modules"] = {
            k: (copy_module(v) if v is not None else None) for k, v in m._modules.items()
        }
        c.__dict__.update(state)
        return c

    return copy_module(model)


def drop_overrides(root: nn.Module) -> None:
    """Remove the per-instance ``forward`` that fxprobe installs on copied region roots."""
    for m in root.modules():
        m.__dict__.pop("forward", None)
