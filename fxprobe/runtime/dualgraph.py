"""The module :func:`fxprobe.extractor` returns: an ``fx.GraphModule`` holding a train and an
eval graph, switched by ``.train()`` / ``.eval()`` as torchvision's ``DualGraphModule`` does, and
carrying timm-style ``feature_info`` (channels and stride of each returned value).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx, nn
from torch.fx.graph_module import _copy_attr

from ..core.errors import FxProbeError
from .layout import BlockFormat, contradiction, reading, stride


class ExtractorModule(fx.GraphModule):
    """An ``fx.GraphModule`` with one graph per mode; ``train(mode)`` runs that mode's graph.

    Code that branches on ``self.training`` was traced once per mode, so switching the mode
    switches the control flow too, not only what BatchNorm and Dropout do. A mode whose graph
    could not be built (its trace failed, or a requested site exists only in the other mode)
    raises the error of that build when switched to. Pickling keeps the current mode's graph
    only (as a plain ``GraphModule``, from its code); ``copy.deepcopy`` keeps both.
    """

    # TorchScript compiles properties and reads class annotations: keep it off both.
    __jit_unused_properties__ = [*fx.GraphModule.__jit_unused_properties__, "feature_info",
                                 "_info"]

    def attach(self, other: nn.Module | None, graphs: Mapping[bool, fx.Graph],
               failures: Mapping[bool, FxProbeError],
               entries: Mapping[bool, list[dict[str, Any]]],
               layout: BlockFormat = "NCHW") -> None:
        """Give the module its other mode's graph (submodules copied from ``other``, the tree
        it was traced on), the errors of modes that failed, and each mode's per-output
        metadata (``module``, ``name``, and ``num_chs``/``reduction`` where the model's
        ``feature_info`` gives them), and the layout the model declares for its 4-d maps."""
        self._graphs: dict[bool, fx.Graph] = dict(graphs)
        self._failures: dict[bool, FxProbeError] = dict(failures)
        self._entries: dict[bool, list[dict[str, Any]]] = {
            mode: [dict(d) for d in e] for mode, e in entries.items()}
        self._fixed: frozenset[str] = frozenset(
            d["name"] for e in entries.values() for d in e if "num_chs" in d)
        self._pending: set[bool] = {mode for mode, e in entries.items()
                         if any(d["name"] not in self._fixed for d in e)}
        self._layout: BlockFormat = layout
        if other is not None:
            for graph in graphs.values():
                if graph is not self.graph:
                    _copy_graph_attrs(other, self, graph)

    @property
    def _info(self) -> list[dict[str, Any]]:
        return self._entries.get(self.training, [])

    def train(self, mode: bool = True) -> ExtractorModule:
        graphs = self.__dict__.get("_graphs")
        if graphs is not None and graphs.get(mode) is not self.graph:
            if mode not in graphs:
                failure = self._failures[mode]
                raise type(failure)(
                    f"this extractor has no {'train' if mode else 'eval'}-mode graph; "
                    f"building it failed: {failure}")
            self.graph = graphs[mode]  # the setter recompiles the forward
        return super().train(mode)  # type: ignore[return-value]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = super().__call__(*args, **kwargs)
        if not torch.compiler.is_compiling() and self.training in self._pending:
            self._measure(args[0] if args else None, out)
            self._pending.discard(self.training)
        return out

    @property
    def feature_info(self) -> list[dict[str, Any]]:
        """One dict per returned value, in order, as timm's ``feature_info``: ``module`` (the
        site), ``name`` (its key in the returned dict), ``num_chs`` (the channels) and
        ``reduction`` (the input's height over the map's, for 4-D maps of a 4-D input).
        From the model's ``feature_info`` where it lists the site, else measured at the first
        call in each mode: the channels of a 4-D map in the layout the model declares (timm's
        ``output_fmt``: Swin's are NHWC), else NCHW, and dim 1 of a 2-D value. ``None`` before
        the first call, for values of other ranks (a 3-D value may be ``(B, tokens, C)`` or
        ``(B, C, L)``), and for a map whose shape fits the other layout and not the declared
        one (torchvision's Swin declares nothing; see ``fxprobe.features(block_fmt=)``)."""
        return [dict(d) for d in self._info]

    def channels(self) -> list[int | None]:
        """The channels of each returned value (timm's ``feature_info.channels()``; see
        :attr:`feature_info` for where they are None)."""
        return [d.get("num_chs") for d in self._info]

    def reduction(self) -> list[int | None]:
        """The stride of each returned value against the input (timm's
        ``feature_info.reduction()``)."""
        return [d.get("reduction") for d in self._info]

    def _measure(self, x: Any, out: Any) -> None:
        values = out if isinstance(out, dict) else out[1] if (
            isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)) else None
        if values is None:
            return
        for d in self._info:
            if d["name"] in self._fixed:
                continue
            v = values.get(d["name"])
            d["num_chs"] = d["reduction"] = None
            if isinstance(v, torch.Tensor) and v.dim() == 2:
                d["num_chs"] = int(v.shape[1])
            elif isinstance(v, torch.Tensor) and v.dim() == 4:
                image = x if isinstance(x, torch.Tensor) and x.dim() == 4 else None
                layout: BlockFormat = self.__dict__.get("_layout", "NCHW")
                if contradiction(v, layout, image, None) is None:
                    c, h, _ = reading(v, layout)
                    d["num_chs"], d["reduction"] = c, stride(image, h)

    def _deepcopy_init(self) -> Callable[..., None]:
        def init(res: ExtractorModule, fake: nn.Module, graph: fx.Graph) -> None:
            fx.GraphModule.__init__(res, fake, graph)
            state = fake.__dict__
            res._graphs, res._failures = state["_graphs"], state["_failures"]
            res._entries, res._fixed = state["_entries"], state["_fixed"]
            res._pending, res._layout = state["_pending"], state.get("_layout", "NCHW")
            for g in res._graphs.values():
                if g is not graph:
                    _copy_graph_attrs(fake, res, g)
        return init


def _copy_graph_attrs(source: nn.Module, target: nn.Module, graph: fx.Graph) -> None:
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module") and isinstance(node.target, str):
            obj: Any = target
            for part in node.target.split("."):
                obj = getattr(obj, part, None)
            if obj is None:
                _copy_attr(source, target, node.target)


def model_info(model: nn.Module) -> dict[str, dict[str, Any]]:
    """timm's ``feature_info`` of ``model`` by module path (empty when it has none usable)."""
    found: Any = getattr(model, "feature_info", None)
    if callable(getattr(found, "get_dicts", None)):
        found = found.get_dicts()
    if not isinstance(found, (list, tuple)):
        return {}
    # An entry hooked before its module (timm's feature_location="expansion": the input of
    # conv_pwl) describes that module's input, not the value its site returns: it is left out.
    return {d["module"]: d for d in found if isinstance(d, dict)
            and isinstance(d.get("module"), str) and "num_chs" in d and "reduction" in d
            and d.get("hook_type") != "forward_pre"}
