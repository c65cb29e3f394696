"""Bad input gets an FxProbeError that says what was wrong and how to fix it."""

from __future__ import annotations

import re

import pytest
import torch
import zoo

import fxprobe


def test_not_a_module() -> None:
    with pytest.raises(fxprobe.UnsupportedModelError, match="nn.Module"):
        fxprobe.tap(lambda x: x)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"capture": "outputs"}, {"copy": "sometimes"},
                                    {"tracer": "jit"}])
def test_bad_option_values(kwargs: dict[str, str]) -> None:
    model, _, _ = zoo.make("shared")
    with pytest.raises(fxprobe.ConfigError) as err:
        fxprobe.tap(model, **kwargs)  # type: ignore[arg-type]
    assert repr(next(iter(kwargs.values()))) in str(err.value) and "one of" in str(err.value)


def test_reading_unknown_and_not_run_sites() -> None:
    model, (x,), _ = zoo.make("shared")
    tapped = fxprobe.tap(model, ops=["fc", "out"])
    with pytest.raises(fxprobe.SiteNotRunError, match="'fc'"):
        tapped.taps["fc"]  # no forward yet
    tapped(x)
    with pytest.raises(fxprobe.UnknownSiteError) as err:
        tapped.taps["fcc"]
    assert isinstance(err.value, KeyError) and "'fc'" in str(err.value)
    assert tapped.taps.get("relu") is None


def test_tap_leaves_the_model_alone_when_it_fails() -> None:
    from reference import model_state, states_equal

    model, _, _ = zoo.make("data_dependent")
    before = model_state(model)
    with pytest.raises(fxprobe.TraceError):
        fxprobe.tap(model, tracer="fx")
    with pytest.raises(fxprobe.SelectorError):
        fxprobe.tap(model, ops="nothing*here", tracer="hooks")
    # tracer="auto": no name dynamo can give inside the module fx cannot trace fits the
    # pattern either (the module tree decides it), so the error comes at tap().
    with pytest.raises(fxprobe.SelectorError, match="nothing"):
        fxprobe.tap(model, ops="nothing*here")
    # a name only dynamo can decide (an op inside that module) waits for the first forward
    tapped = fxprobe.tap(model, ops="gate.nothinghere")
    with pytest.raises(fxprobe.SelectorError, match="nothinghere"), torch.no_grad():
        tapped(*zoo.make("data_dependent")[1])
    assert states_equal(before, model_state(model))


@pytest.mark.parametrize("kwargs, fragment", [
    ({"leaf_modules": 5}, "leaf_modules=5"),
    ({"detach": "no"}, "detach='no'"),
    ({"grad": "yes"}, "grad='yes'"),
    ({"sample_size": True}, "sample_size=True"),
    ({"autowrap_functions": 3}, "autowrap_functions=3"),
])
def test_values_of_the_wrong_type_are_refused(kwargs: dict[str, object], fragment: str) -> None:
    model, _, _ = zoo.make("shared")
    with pytest.raises(fxprobe.ConfigError, match=re.escape(fragment)):
        fxprobe.tap(model, **kwargs)  # type: ignore[arg-type]
    if "leaf_modules" in kwargs:
        with pytest.raises(fxprobe.ConfigError, match=re.escape(fragment)):
            fxprobe.sites(model, **kwargs)  # type: ignore[arg-type]


def test_grads_before_any_backward_say_backward() -> None:
    model, (x,), _ = zoo.make("shared")
    tapped = fxprobe.tap(model, ops="fc", grad=True)
    tapped(x)
    with pytest.raises(fxprobe.SiteNotRunError, match="last backward"):
        tapped.grads["fc"]


def test_every_fallback_of_a_transformer_points_at_a_source_line() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    tapped = fxprobe.tap(transformers.GPT2Model(config).eval())
    assert tapped.fallbacks
    for f in tapped.fallbacks:  # co_varnames failures happen before any model code runs
        path, line, code = f.location.split(":", 2)
        assert path.endswith(".py") and line.isdigit() and code.strip(), str(f)


@pytest.mark.parametrize("leaf, close", [("0", "none"), (["layer1.0.conv9"], "layer1.0.conv1"),
                                         (["no.such.path"], "none")])
def test_leaf_module_paths_must_name_modules(leaf: object, close: str) -> None:
    model, _, _ = zoo.make("resnet")
    bad = leaf if isinstance(leaf, str) else leaf[0]  # type: ignore[index]
    pattern = (f"leaf_modules entry '{re.escape(bad)}' is no module path.*" + (
        r"module types\.$" if close == "none" else f"Did you mean [^?]*'{re.escape(close)}'"))
    for call in (lambda: fxprobe.tap(model, leaf_modules=leaf),
                 lambda: fxprobe.sites(model, leaf_modules=leaf),
                 lambda: fxprobe.extractor(model, return_nodes=["layer1"], leaf_modules=leaf)):
        with pytest.raises(fxprobe.ConfigError, match=pattern):
            call()
    # A path that is one keeps the module a single call: its insides are no sites.
    names = [s.name for s in fxprobe.tap(model, leaf_modules="layer1").sites]
    assert "layer1" in names and not any(n.startswith("layer1.") for n in names)


def test_every_table_checks_fmt_the_same_way() -> None:
    model, (x,), _ = zoo.make("shared")
    tapped = fxprobe.tap(model, ops=["fc", "out"], reduce="stats")
    tapped(x)
    tables = {
        "stats_table": lambda fmt: fxprobe.stats_table(tapped.taps, fmt=fmt),
        "TappedModule.summary": lambda fmt: tapped.summary(fmt=fmt),
        "summary": lambda fmt: fxprobe.summary(fxprobe.sites(model), fmt=fmt),
        "Table.render": lambda fmt: tapped.summary().render(fmt),
        "StatsLogger": lambda fmt: fxprobe.StatsLogger(tapped, fmt=fmt),
        "dist.CrossRankStatsLogger": lambda fmt: fxprobe.dist.CrossRankStatsLogger(tapped, fmt=fmt),
    }
    for bad in ("bogus", "Github", 3):
        said = set()
        for name, make in tables.items():
            with pytest.raises(fxprobe.ConfigError) as err:
                make(bad)
            said.add(str(err.value))
            assert f"fmt={bad!r} is not a table format" in str(err.value), name
        assert len(said) == 1, said  # one check, one message
    for good in ("text", "github", "markdown", "html", "plain"):
        for make in tables.values():
            make(good)
    assert fxprobe.stats_table(tapped.taps, fmt="text") == fxprobe.stats_table(tapped.taps)
    for fmt in ("github", "markdown"):
        assert fxprobe.stats_table(tapped.taps, fmt=fmt).startswith("| site")
        assert str(tapped.summary(fmt=fmt)).startswith("| name")


def test_a_function_in_to_says_where_it_goes() -> None:
    # CallbackSink and TensorBoardSink are Sinks, accepted (tests/test_vocabulary.py)
    model, _, _ = zoo.make("shared")
    with pytest.raises(fxprobe.ConfigError) as err:
        fxprobe.tap(model, to=print)
    said = str(err.value)
    assert "to=print is not accepted" in said, said
    assert "fxprobe.StatsLogger(tapped, every=N, sink=...)" in said and "fn=" in said
    assert "not a device torch knows" not in said
