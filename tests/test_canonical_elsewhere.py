"""Canonical transformer names where a model has none: torch.fx and hooks name sites by module
path and op, so the extractor (torch.fx only) and a traced tap say why such a name matches
nothing, instead of only listing close site names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxprobe


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("name", ["blocks.*.resid_post", "blocks.0.attn.q", "logits"])
def test_a_canonical_name_on_a_model_without_them_says_where_they_exist(name: str) -> None:
    with pytest.raises(fxprobe.SelectorError, match="canonical transformer name") as e:
        fxprobe.extractor(_model(), ops=name)
    assert "dynamo" in str(e.value)
    with pytest.raises(fxprobe.SelectorError, match="canonical transformer name"):
        fxprobe.tap(_model(), ops=name, tracer="fx")


def test_a_module_path_is_not_taken_for_a_canonical_name() -> None:
    with pytest.raises(fxprobe.SelectorError) as e:
        fxprobe.extractor(_model(), ops="blockz.0")
    assert "canonical" not in str(e.value)
    model, x = _model(), torch.randn(2, 4)
    out, values = fxprobe.extractor(model, ops="1")(x)  # a real site still works
    torch.testing.assert_close(values["1"], torch.relu(model[0](x)))
    torch.testing.assert_close(out, model(x))
