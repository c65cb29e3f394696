"""The public surface: tap's options declared once, ``__all__`` grouped and documented."""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest
import torch
from torch import nn

import fxprobe
from fxprobe.core.options import TapKwargs, TraceOptions, declared, make_options
from fxprobe.core.record import Recording

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _keywords(f: object) -> dict[str, object]:
    return {p.name: p.default for p in inspect.signature(f).parameters.values()  # type: ignore[arg-type]
            if p.kind is p.KEYWORD_ONLY}


def test_taps_options_are_declared_once_and_every_entry_point_shows_them() -> None:
    options = {name: default for name, (_, default) in declared(TapKwargs).items()}
    assert len(options) == 14 and options["keep"] == "last" and options["capture"] == "output"
    assert _keywords(fxprobe.tap) == options
    trace = {name: default for name, (_, default) in declared(TraceOptions).items()}
    assert set(trace) == {"tracer", "leaf_modules", "autowrap_functions"}
    assert {k: v for k, v in _keywords(fxprobe.sites).items() if k in trace} == trace
    assert {k: v for k, v in _keywords(fxprobe.extractor).items() if k in trace} == {
        **trace, "tracer": "fx"}  # an extractor is one fx graph
    source = (ROOT / "fxprobe/api.py").read_text()
    assert not re.search(r"\b(grad_fn|sample_size|leaf_modules): [A-Z]", source)  # no signature
    assert not re.search(r"\bsample_size=sample_size\b", source)  # no passing on, one by one
    doc = fxprobe.tap.__doc__ or ""
    assert all(f"    {name}:" in doc for name in options), "each option has its line in Args"


def test_a_misspelt_option_is_refused_with_the_closest_name() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    for call, where in ((lambda: fxprobe.tap(model, captrue="input"), "fxprobe.tap"),
                        (lambda: fxprobe.sites(model, tracr="fx"), "fxprobe.sites"),
                        (lambda: fxprobe.extractor(model, leaf_module=[]), "fxprobe.extractor")):
        with pytest.raises(TypeError, match=rf"{where}\(\) got an unexpected keyword .*"
                                            r"Did you mean '(capture|tracer|leaf_modules)'"):
            call()  # type: ignore[no-untyped-call]


def test_options_given_in_part_keep_the_declared_defaults_for_the_rest() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    tapped = fxprobe.tap(model, ops=nn.ReLU, keep=2)
    assert tapped.options == make_options(keep=2)
    tapped(x)
    tapped(2 * x)
    assert [torch.equal(h["1"], torch.relu(model[0](a))) for h, a in
            zip(tapped.history, (x, 2 * x), strict=True)] == [True, True]
    scripted = fxprobe.tap(torch.jit.script(model), keep=2)  # an artifact: the same options
    scripted(x)
    assert torch.equal(scripted.taps["1"], torch.relu(model[0](x)))
    with pytest.raises(fxprobe.ConfigError, match="capture='input' is not supported"):
        fxprobe.tap(torch.jit.script(model), capture="input")


def test_the_device_values_go_to_is_stored_once() -> None:
    options = make_options(to="cpu")
    rec = Recording(options)
    assert rec.options is options and "to" not in vars(rec) and not hasattr(rec, "to")
