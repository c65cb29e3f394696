"""The public surface: tap's options declared once, ``__all__`` grouped and documented."""

from __future__ import annotations

import importlib
import inspect
import os
import pathlib
import re
import subprocess
import sys

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
    assert len(options) == 15 and options["keep"] == "last" and options["capture"] == "output"
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


def _documented() -> list[list[str]]:
    """The groups of one-line entries of docs/api.md's "Public names" section."""
    text = (ROOT / "docs/api.md").read_text()
    section = text.split("## Public names", 1)[1].split("\n## ", 1)[0]
    groups: list[list[str]] = []
    for block in section.split("\n\n"):
        names = re.findall(r"^- `(\w+)`: \S", block, flags=re.M)
        if names:
            groups.append(names)
    return groups


def test_every_public_name_has_its_one_line_in_the_api_reference_and_only_those() -> None:
    documented = [n for g in _documented() for n in g]
    assert sorted(documented) == sorted(fxprobe.__all__), (
        set(documented) ^ set(fxprobe.__all__))
    assert len(documented) == len(set(documented))


def test_all_is_grouped_by_role_each_group_sorted_as_the_reference_groups_it() -> None:
    source = (ROOT / "fxprobe/__init__.py").read_text()
    listing = source.split("__all__ = [", 1)[1].split("]", 1)[0]
    groups = [re.findall(r'"(\w+)"', g) for g in re.split(r"\n\s*#[^\n]*", listing) if
              re.search(r'"\w+"', g)]
    assert [n for g in groups for n in g] == list(fxprobe.__all__)
    assert all(g == sorted(g) for g in groups) and len(groups) >= 8
    assert groups == _documented()


def test_the_layer_packages_are_not_in_the_public_namespace() -> None:
    layers = ["api", "capture", "cli", "core", "frontends", "present", "runtime", "sinks"]
    # What a user sees after ``import fxprobe`` (here, other tests have imported submodules by
    # path, which Python binds on the package):
    script = (f"import fxprobe; print([n for n in {layers!r} if n in vars(fxprobe) "
              "or n in dir(fxprobe)])")
    shown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert shown.stdout.strip() == "[]", shown.stdout + shown.stderr
    assert not [n for n in layers if n in dir(fxprobe)]
    assert dir(fxprobe) == sorted(fxprobe.__all__)
    site = importlib.import_module("fxprobe.core.site")  # importable by path, as Python says
    assert site.Site is fxprobe.Site
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fxprobe.nope  # noqa: B018
