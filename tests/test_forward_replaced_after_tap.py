"""A forward set on one of the model's modules after ``tap()`` (a wrapper installed later) is
not what the tapped module runs (it runs a copy, built at ``tap()``): the next forward says
so, where it used to return values that were no longer the model's in silence. Changes the
tapped module does follow stay followed: weights changed in place, ``load_state_dict``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxprobe
from fxprobe.core.errors import UsageError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("tracer", ["fx", "dynamo", "hooks"])
def test_a_forward_replaced_after_tap_is_refused_not_ignored(tracer: str) -> None:
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops=["a", "b"], tracer=tracer)
    with torch.no_grad():
        torch.testing.assert_close(tapped(x), model(x))
        model.a.weight.mul_(2)  # followed: the copy shares the parameters
        torch.testing.assert_close(tapped(x), model(x))
        model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
        torch.testing.assert_close(tapped(x), model(x))
        before = model(x)
        own = model.a.forward
        model.a.forward = lambda *a, **k: own(*a, **k) * 2  # what the tapped one would miss
        assert not torch.allclose(model(x), before)  # the model's values did change
        with pytest.raises(UsageError, match=r"'a'.*after fxprobe.tap\(\)"):
            tapped(x)
        del model.a.forward  # as it was at tap(): runs again, equal to the model
        torch.testing.assert_close(tapped(x), model(x))
