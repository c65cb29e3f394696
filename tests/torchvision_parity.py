"""fxprobe against torchvision's feature extraction; run by ``tests/test_torchvision.py``.

It needs torchvision, which the test environment may lack, so the test runs it with another
Python (see ``.ci/tv-env``) and reads the one JSON object it prints:

    python tests/torchvision_parity.py [--values] MODEL ...

``names``: for each model (built with ``weights=None``), where ``fxprobe.sites`` differs from
``get_graph_node_names`` in eval and train mode (``null`` where equal), and fxprobe's fallbacks.
``values`` (with ``--values``): for resnet18 and vit_b_16, where a value ``fxprobe.tap`` or
``fxprobe.extractor`` captured differs from torchvision's ``create_feature_extractor`` or, where
a later in-place op overwrites torchvision's value, from a reference cloned by forward hooks.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
import warnings
from typing import Any

import torch
import torchvision
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import fxprobe

# Detection and segmentation models' backbones ("model.backbone"), and whole models.
BACKBONES = ["fasterrcnn_mobilenet_v3_large_fpn.backbone", "retinanet_resnet50_fpn.backbone",
             "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large", "fcn_resnet50"]


def build(spec: str) -> nn.Module:
    """The model (``name`` or ``name.attr``) without random initialisation where torch allows:
    names need no values."""
    name, _, attr = spec.partition(".")
    builder = torchvision.models.get_model_builder(name)
    kwargs: dict[str, Any] = {"weights": None}
    if "weights_backbone" in inspect.signature(builder).parameters:
        kwargs["weights_backbone"] = None
    try:
        with torch.device("meta"):
            model = builder(**kwargs)
    except (NotImplementedError, RuntimeError):  # a builder that reads tensor values (regnet)
        model = builder(**kwargs)
    return model.get_submodule(attr) if attr else model


def first_difference(got: list[str], expected: list[str]) -> str | None:
    if got == expected:
        return None
    i = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
             min(len(got), len(expected)))
    return (f"{len(got)} names vs torchvision's {len(expected)}; first difference at {i}: "
            f"fxprobe {got[i:i + 3]} torchvision {expected[i:i + 3]}")


def compare_names(model: nn.Module) -> dict[str, Any]:
    tv_train, tv_eval = get_graph_node_names(model, suppress_diff_warning=True)
    result: dict[str, Any] = {"fallbacks": []}
    for mode, expected in (("eval", tv_eval), ("train", tv_train)):
        got = fxprobe.sites(model, train=mode == "train")
        result[mode] = first_difference(list(got), expected)
        result["fallbacks"] += [f"{mode}: {f}" for f in got.fallbacks]
    return result


def _clone(module: nn.Module, store: dict[str, torch.Tensor], key: str, *, inputs: bool = False
           ) -> Any:
    if inputs:
        return module.register_forward_pre_hook(
            lambda m, a: store.__setitem__(key, a[0].detach().clone()))
    return module.register_forward_hook(
        lambda m, a, out: store.__setitem__(key, out.detach().clone()))


def _overwritten_resnet18(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """bn1 and layer1.0.add as computed, before ReLU(inplace=True) overwrites them."""
    seen: dict[str, torch.Tensor] = {}
    handles = [_clone(model.bn1, seen, "bn1"), _clone(model.layer1[0], seen, "in", inputs=True),
               _clone(model.layer1[0].bn2, seen, "bn2")]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return {"bn1": seen["bn1"], "layer1.0.add": seen["bn2"] + seen["in"]}


VALUE_SITES = {
    "resnet18": ["conv1", "bn1", "maxpool", "layer1.0.add", "layer2.1.relu_1", "layer4",
                 "flatten", "fc"],
    "vit_b_16": ["conv_proj", "reshape", "cat", "encoder.layers.encoder_layer_0.getitem",
                 "encoder.layers.encoder_layer_0.add",
                 "encoder.layers.encoder_layer_3.mlp", "encoder.layers.encoder_layer_11.add_1",
                 "encoder.ln", "getitem_5", "heads.head"],
}
OVERWRITTEN = {"resnet18": _overwritten_resnet18}


def compare_values(name: str) -> dict[str, str | None]:
    """Per site, how fxprobe's value differs from the reference (None: bitwise equal)."""
    torch.manual_seed(0)
    # 64x64 images keep it fast; vit's graph checks the size it was built for.
    kwargs = {"image_size": 64} if name.startswith("vit") else {}
    model = torchvision.models.get_model(name, weights=None, **kwargs).eval()
    x = torch.randn(2, 3, 64, 64)
    sites = VALUE_SITES[name]
    reference = OVERWRITTEN[name](model, x) if name in OVERWRITTEN else {}
    with torch.no_grad():
        tv = create_feature_extractor(model, return_nodes=sites)(x)
        tapped = fxprobe.tap(model, ops=sites)
        tapped(x)
        _, extracted = fxprobe.extractor(model, ops=sites)(x)
    result: dict[str, str | None] = {}
    for site in reference:  # shows that the reference is needed: torchvision's value is not it
        if torch.equal(tv[site], reference[site]):
            result[f"{site} (torchvision)"] = "torchvision's value is no longer overwritten"
    for site in sites:
        expected = reference.get(site, tv[site])
        errors = []
        for how, got in (("tap", tapped.taps[site]), ("extractor", extracted[site])):
            try:
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
            except AssertionError as e:
                errors.append(f"{how}: {str(e).splitlines()[0]}")
        result[site] = "; ".join(errors) or None
    return result


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    values = "--values" in argv
    models = [a for a in argv if not a.startswith("--")]
    if "--all" in argv:
        models = torchvision.models.list_models(module=torchvision.models) + BACKBONES
    start = time.perf_counter()
    out: dict[str, Any] = {"versions": {"torch": torch.__version__,
                                        "torchvision": torchvision.__version__},
                           "names": {}, "values": {}}
    for name in models:
        try:
            out["names"][name] = compare_names(build(name))
        except Exception as e:  # one model's failure is reported with the others
            out["names"][name] = {"error": f"{type(e).__name__}: {e}"}
    if values:
        for name in VALUE_SITES:
            out["values"][name] = compare_values(name)
    out["seconds"] = round(time.perf_counter() - start, 1)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
