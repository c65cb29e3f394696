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


# Under torch.compile(tapped) with tracer="fx", dynamo compiles run()'s check of the model:
# a forward or attribute set on the model after the first compiled calls must still be
# refused there, not skipped by a compiled frame that guards on neither.
@pytest.mark.parametrize("change", ["forward", "attribute"])
def test_a_change_after_tap_is_refused_under_torch_compile(change: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops=["a", "b"], tracer="fx")
    compiled = torch.compile(tapped)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(compiled(x), model(x))
        compiled(x)
        if change == "forward":
            own = model.a.forward
            model.a.forward = lambda *a, **k: own(*a, **k) * 2
        else:
            model.scale = 3.0
        with pytest.raises(UsageError, match=r"after fxprobe.tap\(\)"):
            compiled(x)


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # state the forward keeps for itself
        return self.a(x)


def test_state_a_forward_keeps_for_itself_is_no_change_of_the_users() -> None:
    # The model's own calls change such attributes (self.calls, dynamic RoPE's
    # max_seq_len_cached); refusing the tapped module for them would be a false alarm.
    torch.manual_seed(0)
    model = Counting().eval()
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops=["a"], tracer="hooks")
    for _ in range(2):
        torch.testing.assert_close(model(x), tapped(x))
    assert model.calls == 2


def test_dynamic_rope_state_changed_by_the_models_own_calls_is_followed() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, max_position_embeddings=8,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    short, long = torch.tensor([[1, 2, 3, 4]]), torch.randint(0, 50, (1, 12))
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer="hooks")
    with torch.no_grad():
        for ids in (short, long, short, long, long, short):  # the tapped module first
            torch.testing.assert_close(tapped(ids).logits, model(ids).logits)
        for ids in (long, short, long):  # then the model first: followed, as learned
            want = model(ids).logits
            torch.testing.assert_close(tapped(ids).logits, want)
        # Known limit: the model's own call changing that state before any call of the
        # tapped module did is refused (loud), as a user's change would be.
        model(short)  # back to the original length
        fresh = fxprobe.tap(model, ops=nn.Linear, tracer="hooks")
        model(long)
        with pytest.raises(UsageError, match="max_seq_len_cached"):
            fresh(short)
