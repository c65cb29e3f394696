"""Bad input gets an FxProbeError that says what was wrong and how to fix it."""

from __future__ import annotations

import pytest
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
        fxprobe.tap(model, ops="nothing*here")
    assert states_equal(before, model_state(model))
