"""Summary tables: cells against eager hooks and hand-computed values, in every format."""

from __future__ import annotations

import dataclasses
import html
from typing import Any

import pytest
import torch
import zoo
from reference import hook_values
from torch import nn

import fxprobe
from fxprobe.core.record import InOut
from fxprobe.present.summary import describe_value, human_bytes


def rows(table: fxprobe.Table) -> dict[str, dict[str, str]]:
    return {r[0]: dict(zip(table.headers, r, strict=True)) for r in table.rows}


def test_tapped_summary_matches_eager_hooks() -> None:
    model, args, _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, ops=[nn.Conv2d, torch.flatten])
    tapped(*args)
    table = tapped.summary()
    assert table.headers == ("name", "op", "how", "shape", "dtype", "bytes")
    assert [r[0] for r in table.rows] == [s.name for s in tapped.sites]
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    _, ref = hook_values(model, convs, *args)
    by_name = rows(table)
    for path in convs:
        t = ref[path]
        row = by_name[path]
        assert row["op"] == "Conv2d" and row["how"] == "fx"
        assert row["shape"] == str(list(t.shape)) and row["dtype"] == "float32"
        assert row["bytes"] == human_bytes(t.numel() * 4)
    assert by_name["flatten"]["shape"] == "[2, 16]"
    assert by_name["flatten"]["op"] == "torch.flatten"
    total = sum(ref[p].numel() * 4 for p in convs) + 2 * 16 * 4
    assert f"{human_bytes(total)} in all" in table.notes[0]


def test_hook_sites_repeated_calls_and_sites_that_did_not_run() -> None:
    model, args, _ = zoo.make("shared")
    tapped = fxprobe.tap(model, tracer="hooks")
    tapped(*args)
    _, ref = hook_values(model, ["fc", "out"], *args)
    table = tapped.summary()
    assert [r[0] for r in table.rows] == ["fc", "fc_1", "out"]
    assert {r[2] for r in table.rows} == {"hook"}
    assert rows(table)["fc_1"]["shape"] == str(list(ref["fc_1"].shape))

    model, args, _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, ops=[nn.Linear])
    tapped(*args)
    took_pos = bool(model.stem(args[0]).sum() > 0)
    skipped = "gate.neg.0" if took_pos else "gate.pos"
    assert rows(tapped.summary())[skipped]["shape"] == "(not run)"
    # tracer="auto" ran the module fx cannot trace under dynamo: the notes say so.
    assert any(n.startswith("gate: ") and "captured by dynamo" in n
               for n in tapped.summary().notes)
    assert rows(tapped.summary())[skipped]["how"] == "dynamo"


@dataclasses.dataclass(frozen=True)
class Stats:
    """Stands for the record ``reduce="stats"`` keeps (matched by class name and fields)."""

    shape: tuple[int, ...]
    dtype: str
    mean: float
    max: float


def test_stats_records_get_their_own_columns() -> None:
    site = fxprobe.Site("fc", "fx", "call_module", "fc", "fc", nn.Linear)
    from fxprobe.present.summary import tapped_table

    table = tapped_table([site], {"fc": Stats((2, 3), "torch.float32", 0.123456, 2.0)}, ())
    assert table.headers == ("name", "op", "how", "shape", "dtype", "bytes", "mean", "max")
    assert table.rows[0] == ("fc", "Linear", "fx", "[2, 3]", "float32", "", "0.1235", "2")


def test_real_stats_reduce_matches_eager_values() -> None:
    model, args, _ = zoo.make("encoder")
    tapped = fxprobe.tap(model, ops=nn.Linear, reduce="stats")
    tapped(*args)
    table = tapped.summary()
    _, ref = hook_values(model, ["fc1"], *args)
    row = rows(table)["fc1"]
    assert {"mean", "std", "min", "max"} <= set(table.headers)
    assert float(row["mean"]) == pytest.approx(ref["fc1"].mean().item(), rel=1e-3, abs=1e-6)
    assert float(row["max"]) == pytest.approx(ref["fc1"].max().item(), rel=1e-3)
    assert row["shape"] == str(list(ref["fc1"].shape))


def test_sites_table_lists_every_site_and_fallbacks() -> None:
    model, _, _ = zoo.make("data_dependent")
    listing = fxprobe.sites(model)
    table = fxprobe.summary(listing)
    assert table.headers == ("name", "op", "module path", "how")
    assert [r[0] for r in table.rows] == list(listing)
    assert rows(table)["gate.pos"]["how"] == "hook"
    assert rows(table)["stem"]["how"] == "fx"
    assert rows(table)["relu"]["op"] == "torch.relu"
    assert "1 by module hook only" in table.notes[0]
    assert "gate (Gate)" in table.notes[1]
    assert fxprobe.summary(model).rows == table.rows  # a model is listed the same way


@pytest.mark.parametrize("fmt", ["text", "github", "html"])
def test_formats(fmt: str) -> None:
    model, args, _ = zoo.make("multi_io")
    tapped = fxprobe.tap(model, ops="a*")
    tapped(*args)
    text = str(tapped.summary(fmt=fmt))
    if fmt == "github":
        assert text.splitlines()[0].startswith("| name")
        assert set(text.splitlines()[1]) <= set("|-: ")
    elif fmt == "html":
        assert text.startswith("<table>") and "<td>a_1</td>" in text
        assert "<p>" in text
    else:
        assert text.splitlines()[0].split() == ["name", "op", "how", "shape", "dtype", "bytes"]
    assert tapped.summary()._repr_html_().startswith("<table>")


def test_html_escapes_cells() -> None:
    table = fxprobe.Table(("name",), (("<b>&</b>",),), ("a < b",), "html")
    assert html.escape("<b>&</b>") in str(table) and "<p>a &lt; b</p>" in str(table)


def test_bad_format_and_bad_object() -> None:
    model, args, _ = zoo.make("shared")
    tapped = fxprobe.tap(model)
    with pytest.raises(fxprobe.ConfigError, match="'bogus' is not a table format"):
        tapped.summary(fmt="bogus")
    with pytest.raises(fxprobe.UnsupportedModelError, match="takes a TappedModule"):
        fxprobe.summary(42)


@pytest.mark.parametrize("value, shape, dtype, nbytes", [
    (torch.zeros(2, 3), "[2, 3]", "float32", 24),
    (torch.zeros((), dtype=torch.int64), "[]", "int64", 8),
    ((torch.zeros(2), (torch.zeros(1, dtype=torch.float16),)), "([2], ([1],))",
     "float32, float16", 10),
    ({"a": torch.zeros(4), "b": 3}, "{a: [4], b: int}", "float32", 16),
    ([torch.zeros(1)] * 5, "[[1], [1], [1], [1], ...]", "float32", 20),
    (InOut((torch.zeros(9),), torch.zeros(2, 2)), "[2, 2]", "float32", 16 + 36),
    (7, "7", "int", None),
    (torch.Size([2, 5]), "[2, 5]", "Size", None),
    (None, "None", "NoneType", None),
])
def test_describe_value(value: Any, shape: str, dtype: str, nbytes: int | None) -> None:
    info = describe_value(value)
    assert (info.shape, info.dtype, info.nbytes) == (shape, dtype, nbytes)


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (None, 0, 1023, 1024, 1536, 5 * 2**20, 3 * 2**30)] == [
        "", "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "5.0 MiB", "3.0 GiB"]


def test_site_names_print_as_a_table() -> None:
    import zoo

    model, _, _ = zoo.make("data_dependent")
    text = str(fxprobe.sites(model).table())
    rows = {line.split()[0]: line.split()[-1] for line in text.splitlines()[2:11]}
    assert rows["gate.pos"] == "hook" and rows["stem"] == "fx" and rows["relu"] == "fx"
    assert "| gate.pos" in str(fxprobe.sites(model).table("github"))
