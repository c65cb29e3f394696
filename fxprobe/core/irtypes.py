"""The type rules of the IR frontends (TorchScript, torch.export): what a type name or an op
spelling in a deployed graph means in fxprobe's vocabulary, without Python classes at hand.

Both artifact frontends read module types as qualified names (``torch.nn.modules.conv.Conv2d``,
``torchvision.ops.misc.Conv2dNormActivation``) and in-place ops as ``relu_``: these rules say
which names are ``torch.nn`` leaves, which are blocks torchvision keeps whole, and how fx would
have spelled an op.
"""

from __future__ import annotations

import importlib
import inspect
import linecache
import os
import re
import sys

import torch
from torch import nn

from .ops import method_key

_MANGLE = re.compile(r"___torch_mangle_\d+\.")
_CONTAINER_TYPES = ("torch.nn.modules.container.",)
_TORCH_DIR = os.path.dirname(torch.__file__)
_FRAME = re.compile(r'File "([^"]+)", line (\d+)|^(.+?)\((\d+)\): ', re.M)


def type_name(qualified: str) -> str:
    """``__torch__.torchvision.models.resnet.___torch_mangle_3.BasicBlock`` -> the Python name."""
    name = _MANGLE.sub("", qualified)
    return name[len("__torch__."):] if name.startswith("__torch__.") else name


def python_type(name: str) -> type[nn.Module] | None:
    """The class of a ``torch.*`` module type name; None for anything else (never imports it)."""
    if not name.startswith("torch."):
        return None
    module, _, cls = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), cls, None)
    except ImportError:
        return None
    return found if isinstance(found, type) and issubclass(found, nn.Module) else None


def library_blocks() -> tuple[type, ...]:
    """The ``nn.Module`` classes that ``torchvision.ops`` exports (``Conv2dNormActivation``,
    ``MLP``, ``SqueezeExcitation``, ``StochasticDepth``, ``Permute``...), subclasses included
    (vit's ``MLPBlock``): torchvision's ``get_graph_node_names`` keeps them whole.

    Call it before tracing: while fx traces, ``autowrap_modules`` has replaced these classes in
    ``torchvision.ops`` by wrapper functions.
    """
    # A model holding a torchvision ops module or calling one of its functions has imported
    # torchvision.ops already; fxprobe never imports torchvision itself.
    ops = sys.modules.get("torchvision.ops")
    if ops is None:
        return ()
    return tuple(obj for _, obj in inspect.getmembers(ops)
                 if inspect.isclass(obj) and issubclass(obj, nn.Module))


def is_leaf_type(name: str) -> bool:
    """fx's default leaves: ``torch.nn`` modules but the containers (Sequential, ModuleList)."""
    return name.startswith(("torch.nn.", "torch.ao.nn.")) and not name.startswith(
        _CONTAINER_TYPES)


def is_block_type(name: str) -> bool:
    """A ``torchvision.ops`` module (``Conv2dNormActivation``, ``MLP``...), subclasses included
    when torchvision is already imported: torchvision's get_graph_node_names keeps it whole,
    so its call is listed in the place of the sites inside it (as in the fx frontend)."""
    if name.startswith("torchvision.ops."):
        return True
    if not name.startswith("torchvision.") or "torchvision" not in sys.modules:
        return False  # fxprobe never imports torchvision itself
    module, _, cls = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), cls, None)
    except ImportError:
        return False
    blocks = library_blocks()
    return isinstance(found, type) and bool(blocks) and issubclass(found, blocks)


def is_leaf_function(name: str) -> bool:
    """Functions recorded as one site: torch's (``F.relu``) and ``torchvision.ops``'."""
    return name.startswith(("torch.", "torchvision.ops."))


def op_name(kind: str) -> str:
    """``aten::add_`` -> ``add``, ``aten::__getitem__`` -> ``getitem``."""
    return method_key(kind.partition("::")[2])


def spelled(op: str, frames: str, *, innermost_last: bool) -> str:
    """``relu_`` for ``x.relu_()``, ``add`` for ``out += y``: both are one in-place op in IR.

    fx names the first ``relu_`` and the second ``add``. The user's source line (the
    innermost frame outside torch of ``frames``, when the file is at hand) tells them apart;
    without it the underscore goes.
    """
    if not (op.endswith("_") and not op.startswith("_")):
        return method_key(op)
    lines = []
    for m in _FRAME.finditer(frames):
        path, number = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        if not path.startswith(_TORCH_DIR):  # the user's line, not torch's own code
            lines.append(linecache.getline(path, int(number)))
    line = (lines[-1] if innermost_last else lines[0]) if lines else ""
    return op if re.search(rf"\.{re.escape(op)}\s*\(", line) else method_key(op)
