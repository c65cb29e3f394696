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
    for key in (None, 3, ("1",)):  # not a name: a mapping's get answers its default
        assert tapped.taps.get(key, "none") == "none"
        assert reader.forward(0).get(key, "none") == "none"
        assert cache.get(key, "none") == "none"
        with pytest.raises(fxprobe.UnknownSiteError, match="not a tapped site"):
            tapped.taps[key]
    with pytest.raises(fxprobe.ConfigError, match=r"Did you mean '0'"):
        fxprobe.tap(model, leaf_modules=["0_"])
    with pytest.raises(fxprobe.ConfigError, match=r"Did you mean '0'"):
        fxprobe.to_dot(model, focus="0_")


@pytest.mark.parametrize("old, new", [("CaptureError", "DynamoError"),
                                      ("CaptureInfo", "DynamoInfo")])
def test_an_old_public_name_warns_and_is_the_new_object(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"fxprobe\.{old} is renamed fxprobe\.{new}"):
        value = getattr(fxprobe, old)
    assert value is getattr(fxprobe, new)
    assert old not in fxprobe.__all__ and old not in dir(fxprobe)
    with pytest.warns(DeprecationWarning):
        exec(f"from fxprobe import {old}", {})  # the import statement warns too
    with pytest.raises(AttributeError, match="no attribute 'CaptureErorr'"):
        fxprobe.CaptureErorr  # noqa: B018  # a misspelling is no old name


def test_cross_rank_stats_logger_is_named_apart_from_the_single_rank_one() -> None:
    assert fxprobe.dist.CrossRankStatsLogger is not fxprobe.StatsLogger
    assert "StatsLogger" not in fxprobe.dist.__all__
    with pytest.warns(DeprecationWarning, match="fxprobe.dist.CrossRankStatsLogger"):
        assert fxprobe.dist.StatsLogger is fxprobe.dist.CrossRankStatsLogger
    from fxprobe.core import errors

    with pytest.warns(DeprecationWarning, match="DynamoError"):
        assert errors.CaptureError is fxprobe.DynamoError  # code written against the old name


def test_dynamo_info_is_read_under_its_new_name_and_the_old_one_warns() -> None:
    class Gate(nn.Module):  # data-dependent control flow: fx cannot trace it, dynamo can
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) if x.sum() > 0 else -x

    model = nn.Sequential(nn.Linear(4, 4), Gate())
    tapped = fxprobe.tap(model)
    x = torch.ones(2, 4)
    tapped(x)
    info = tapped.dynamo_info
    assert [i.path for i in info] == ["1"] and isinstance(info[0], fxprobe.DynamoInfo)
    with pytest.warns(DeprecationWarning, match="tapped.captures is renamed tapped.dynamo_info"):
        assert tapped.captures == info
    tapped.remove()


def test_the_graph_walk_is_written_once() -> None:
    walks = {p.relative_to(ROOT).as_posix() for p in (ROOT / "fxprobe").rglob("*.py")
             if re.search(r"\n\s+(\w+) = \w+\.pop\(\)\n\s+if \1 in (\w+)\b.*\n\s+continue\n"
                          r"\s+\2\.add\(\1\)", p.read_text())}
    assert walks == {"fxprobe/core/site.py"}
    from torch import fx

    from fxprobe.core.site import reach

    g = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))).graph
    x, a, b, c, out = list(g.nodes)
    assert reach([b], lambda n: n.all_input_nodes) == {x, a, b}
    assert reach([a], lambda n: n.users) == {a, b, c, out}
    assert reach([a], lambda n: n.users, where=lambda n: n is not c) == {a, b}
    seen = {b}
    assert reach([c], lambda n: n.all_input_nodes, into=seen) is seen and seen == {b, c}


def test_sites_lists_the_one_site_record_that_still_reads_as_its_name() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    listed = fxprobe.sites(model)
    tapped = fxprobe.tap(model, ops=nn.ReLU)
    x = torch.randn(3, 4)
    tapped(x)
    known = tapped.known_sites()
    for seq in (listed, tapped.sites, known):
        assert all(type(s) is fxprobe.Site for s in seq)
    assert listed.names == ("input", "0", "1", "2") and repr(listed) == repr(listed.names)
    assert listed == ("input", "0", "1", "2") and listed[1:3] == ("0", "1")
    assert list(listed) == ["input", "0", "1", "2"] and "1" in listed and "9" not in listed
    assert {"1": "relu"}[listed[2]] == "relu" and str(listed[2]) == f"{listed[2]}" == "1"
    assert listed[2] == tapped.sites[0] and listed[2] != listed[1]
    assert torch.equal(tapped.taps[listed[2]], torch.relu(model[0](x)))  # a Site as the key
    for second in (2 * x, torch.randn(5, 4)):  # a second call and a new shape
        tapped(second)
        assert torch.equal(tapped.taps[tapped.sites[0]], torch.relu(model[0](second)))
    tapped.remove()
    by_record = fxprobe.tap(model, ops=[listed[1], listed[3]])  # a listed Site selects itself
    assert by_record.sites == ("0", "2")
    by_record(x)
    assert torch.equal(by_record.taps["2"], model(x))
    by_record.remove()
    with pytest.warns(DeprecationWarning, match="site.name.startswith"):
        assert listed[1].startswith("0")
    with pytest.warns(DeprecationWarning):
        assert "0" in listed[1]
    with pytest.raises(AttributeError):
        listed[1].no_such_attribute  # noqa: B018


def test_two_listings_are_equal_when_they_name_the_same_sites() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    by_fx, by_hooks = fxprobe.sites(model), fxprobe.sites(model, tracer="hooks")
    script = fxprobe.sites(torch.jit.script(model))
    assert by_fx == script and by_fx[1] != script[1]  # one name, two frontends' records
    assert (by_fx == by_hooks) == (by_fx.names == by_hooks.names)
    assert hash(by_fx) == hash(script)


def test_the_stats_sinks_are_sinks_that_to_accepts() -> None:
    from fxprobe.core.options import Sink

    class Writer:
        def __init__(self) -> None:
            self.scalars: list[tuple[str, float, int]] = []

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.scalars.append((tag, value, step))

    got: list[tuple[dict[str, float], int]] = []
    writer = Writer()
    sinks = (fxprobe.CallbackSink(lambda s, step: got.append((s, step)), fields=["mean", "max"]),
             fxprobe.TensorBoardSink(writer, fields=["mean"]))
    assert all(isinstance(s, Sink) for s in sinks)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    xs = [torch.randn(3, 4), torch.randn(5, 4)]  # two forwards, a new shape
    for sink, keep in zip(sinks, ("last", 2), strict=True):
        tapped = fxprobe.tap(model, ops=nn.ReLU, to=sink, keep=keep)
        for x in xs:
            tapped(x)
        tapped.remove()
    ref = [torch.relu(model[0](x)) for x in xs]
    assert [step for _, step in got] == [0, 1]
    for (scalars, _), r in zip(got, ref, strict=True):
        assert scalars.keys() == {"1/mean", "1/max"}
        assert scalars["1/mean"] == pytest.approx(r.mean().item(), rel=1e-5)
        assert scalars["1/max"] == pytest.approx(r.max().item(), rel=1e-6)
    assert [(t, s) for t, _, s in writer.scalars] == [("1/mean", 0), ("1/mean", 1)]
    assert [v for _, v, _ in writer.scalars] == pytest.approx([r.mean().item() for r in ref],
                                                              rel=1e-5)


def test_the_selection_line_is_written_once() -> None:
    users = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "fxprobe").rglob("*.py")
                   if re.search(r"select\([^()]*as_selectors\(", p.read_text()))
    assert users == ["fxprobe/core/select.py"]
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    dot = fxprobe.to_dot(model, ops=model[1]).source  # a module of the model, by identity
    tapped = fxprobe.tap(torch.jit.script(model), ops="1")
    assert tapped.sites == ("1",) and "1" in dot
