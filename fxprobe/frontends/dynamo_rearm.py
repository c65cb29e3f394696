"""Dynamo's frames made capturable again after the model raised while dynamo traced it.

Where a frame's code raises while dynamo traces it (``raise ValueError`` on a bad argument,
transformers' checks of its inputs), dynamo gives up on the frame and marks its code object
to be skipped for good (its frame execution strategy), then runs it as written, which raises
to the caller. Every later call of that code, with any arguments, then runs without dynamo:
a region's forward without any of fxprobe's graphs (``DynamoError``), or the code after a
graph break (a resume function dynamo made for the model's forward, shared by every tap of
that class) without its sites. :func:`rearm` sets the strategy of the region's own code,
of its modules' forwards and of the resume functions made from them back to dynamo's
default, so the next call is captured (where it already was, dynamo's cache entries still
serve it).
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

from torch import nn


def forward_codes(module: nn.Module) -> list[types.CodeType]:
    """The code objects of the forwards of ``module``'s modules (and of what decorates them),
    short of a function marked for dynamo to leave alone (``torch.compiler.disable``,
    ``torch._dynamo.skip``): its code, and the code it wraps, stay as the user marked them."""
    codes: dict[int, types.CodeType] = {}
    for m in module.modules():
        fn: Any = type(m).forward
        while fn is not None and not getattr(fn, "_torchdynamo_disable", False):
            code = getattr(fn, "__code__", None)
            if isinstance(code, types.CodeType):
                codes[id(code)] = code
            fn = getattr(fn, "__wrapped__", None)
    return list(codes.values())


def rearm(codes: Iterable[types.CodeType]) -> None:
    """Let dynamo capture ``codes`` again, and the resume functions it made from them (see the
    module docstring). Without these internals (another torch): nothing."""
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
        from torch._dynamo.decorators import _nonrecursive_disable_wrapper_code as wrapper
        from torch._dynamo.resume_execution import ContinueExecutionCache
    except ImportError:
        return
    made: dict[int, Any] = getattr(ContinueExecutionCache.cache, "values", {})
    default = _FrameExecStrategy(_FrameAction.DEFAULT, _FrameAction.DEFAULT)
    # the wrapper of every function disabled non-recursively in the process: skipped for good
    todo, seen = list(codes), {id(wrapper)}
    while todo:
        code = todo.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        set_code_exec_strategy(code, default)
        resumed = made.get(id(code))
        if isinstance(resumed, dict):  # each graph break's resume function, by its place
            todo.extend(c for c in resumed.values() if isinstance(c, types.CodeType))
