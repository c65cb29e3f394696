"""One word per idea, one way to say each thing: the did-you-mean hint is written once, old
spellings of renamed names still work for one release with a DeprecationWarning."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from torch import nn

import fxprobe
from fxprobe.core.names import closest, did_you_mean

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_hint_for_a_name_not_found_is_written_once() -> None:
    users = [p.relative_to(ROOT).as_posix() for p in (ROOT / "fxprobe").rglob("*.py")
             if re.search(r"\bdifflib\b", p.read_text())]
    assert users == ["fxprobe/core/names.py"]


def test_did_you_mean_names_the_closest_names_quoted_or_says_nothing() -> None:
    assert did_you_mean("layr1", ["layer1", "layer2", "fc"]) == " Did you mean 'layer1', 'layer2'?"
    assert did_you_mean("zzz", ["layer1"]) == ""
    assert closest("fc", ["fc", "fc", "fc1"]) == ["fc", "fc1"]  # each name once


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_every_lookup_of_a_misspelt_name_gives_the_same_hint(tmp_path: pathlib.Path) -> None:
    model = _mlp()
    tapped = fxprobe.tap(model, to=fxprobe.Disk(tmp_path / "caps"))
    tapped(torch.randn(3, 4))
    tapped.remove()
    hint = "Did you mean '1'"  # every site name of a one-character typo: '1' first
    reader = fxprobe.open_captures(tmp_path / "caps")
    tapped = fxprobe.tap(model, tracer="dynamo")  # per-call caches: dynamo's sites
    tapped(torch.randn(3, 4))
    _, cache = tapped.run_with_cache(torch.randn(3, 4))
    for lookup in (lambda: tapped.taps["1_"], lambda: reader.forward(0)["1_"],
                   lambda: cache["1_"]):
        with pytest.raises(fxprobe.UnknownSiteError, match=re.escape(hint)):
            lookup()
    with pytest.raises(fxprobe.ConfigError, match=r"Did you mean '0'"):
        fxprobe.tap(model, leaf_modules=["0_"])
    with pytest.raises(fxprobe.ConfigError, match=r"Did you mean '0'"):
        fxprobe.to_dot(model, focus="0_")
