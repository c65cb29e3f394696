"""Review 28: changes made to the model after ``tap()`` (a forward or submodule replaced, a mode
set, a class changed) against the untapped model's own output: what the tapped copy does not
follow is refused or said, never returned in silence; what it can follow runs equal to the
model. (Its attribute case is in tests/test_forward_replaced_after_tap.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxprobe
from fxprobe.core.errors import UsageError
from fxprobe.frontends.mirror import ModeChangedWarning


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(4, 2)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x)))) * self.scale


class Doubled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


# A module's class changed on the model after tap() (``m.__class__ = Sub``, as some patching
# libraries do) changes what the model runs; the copy, made of the class at tap(), kept running
# the old forward and returned the old values in silence.
@pytest.mark.parametrize("tracer", ["fx", "dynamo", "hooks"])
def test_a_class_changed_on_a_model_module_after_tap_is_refused(tracer: str) -> None:
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops=["a", "b"], tracer=tracer)
    with torch.no_grad():
        torch.testing.assert_close(tapped(x), model(x))
        before = model(x)
        model.a.__class__ = Doubled
        assert not torch.allclose(model(x), before)
        with pytest.raises(UsageError, match=r"after fxprobe.tap\(\) \('a': its class"):
            tapped(x)
        model.a.__class__ = nn.Linear  # undone: runs again, equal to the model
        torch.testing.assert_close(tapped(x), model(x))


# accelerate's remove_hook_from_module puts back the forward it wrapped as the class's forward
# bound to the instance (``module.forward = module._old_forward``): the model then runs as
# before, but the tapped module refused every call for good (the instance forward was not the
# None seen at tap()).
def test_a_wrapper_installed_then_removed_by_accelerate_after_tap_runs_again() -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.hooks import remove_hook_from_submodules

    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops=["a", "b"], tracer="hooks")
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(tapped(x), want)
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
        with pytest.raises(UsageError, match=r"after fxprobe.tap\(\)"):
            tapped(x)
        remove_hook_from_submodules(model)
        assert vars(model.a).get("forward") is not None  # what accelerate leaves there
        torch.testing.assert_close(model(x), want)
        torch.testing.assert_close(tapped(x), want)
        torch.testing.assert_close(tapped.taps["b"], want)


# ModeChangedWarning is said once per change, but it was warned at torch's Module._call_impl
# line with the same text each time: Python's registry of warnings shown ("default" filter)
# hid every later change that read the same (the model put in train mode a second time,
# another tapped model's change), so Dropout ran in the other mode in silence.
@pytest.mark.parametrize("tracer", ["fx", "hooks"])
def test_each_mode_change_is_said_at_the_callers_line(tracer: str) -> None:
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops=["a", "b"], tracer=tracer)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("default")
        for _ in range(2):
            model.train()
            tapped(x)
            tapped.train()
            model.eval()
            tapped(x)
            tapped.eval()
    said = [w for w in said if issubclass(w.category, ModeChangedWarning)]
    assert [("train" if "train mode" in str(w.message) else "eval") for w in said] == [
        "train", "eval", "train", "eval"]
    assert all(w.filename == __file__ for w in said), [w.filename for w in said]
