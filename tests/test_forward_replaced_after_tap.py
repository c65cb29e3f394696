"""A forward set on one of the model's modules after ``tap()`` (a wrapper installed later) is
not what the tapped module runs (it runs a copy, built at ``tap()``): the next forward says
so, where it used to return values that were no longer the model's in silence. Changes the
tapped module does follow stay followed: weights changed in place, ``load_state_dict``. The
train/eval mode is the tapped module's own: a mode set on the model later is said."""

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
        with pytest.raises(UsageError, match=r"after fxprobe.tap\(\) \('a': forward\)"):
            tapped(x)
        del model.a.forward  # as it was at tap(): runs again, equal to the model
        torch.testing.assert_close(tapped(x), model(x))


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


@pytest.mark.parametrize("tracer", ["fx", "dynamo", "hooks"])
def test_a_mode_changed_on_the_model_after_tap_is_said(tracer: str) -> None:
    # The tapped module keeps a train/eval mode of its own (tapped.eval() leaves the model's
    # flag alone). model.eval() after tap() used to leave its Dropout active in silence: the
    # tapped values were not the model's. Now the next call says which call aligns them.
    torch.manual_seed(0)
    model = Dropped()  # train mode, as constructed
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops=["a", "b"], tracer=tracer)
    model.eval()
    said = r"the model was put in eval mode.*tapped\.eval\(\)"
    with pytest.warns(ModeChangedWarning, match=said):
        out = tapped(x)
    assert not torch.allclose(out, model(x))  # what the warning is about: dropout still ran
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModeChangedWarning)
        tapped(x)  # said once per change
        tapped.eval()
        torch.testing.assert_close(tapped(x), model(x), rtol=0, atol=0)
        model.train()
        model.eval()  # back where it was: nothing changed between two calls
        tapped(x)
    model.drop.train()
    with pytest.warns(ModeChangedWarning, match=r"'drop' of the model was put in train mode.*"
                      r"tapped\.get_submodule\('drop'\)\.train\(\)"):
        tapped(x)
    tapped.get_submodule("drop").train()
    assert not torch.equal(tapped(x), tapped(x))  # dropout now runs, as in the model
    tapped.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModeChangedWarning)
        model.train()  # the model joins the mode the tapped module is in already: no word
        tapped(x)


class Scaled(nn.Module):
    shift = 0.0  # a class attribute an instance may shadow

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.scale + self.shift


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Scaled()
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.inner(x)))


@pytest.mark.parametrize("tracer", ["fx", "dynamo", "hooks"])
def test_an_attribute_set_on_the_model_after_tap_is_refused_not_ignored(tracer: str) -> None:
    # The copy holds the attributes the model had at tap() (by value): self.scale = 3.0 on
    # the model afterwards used to leave the tapped module computing with 1.0, in silence.
    torch.manual_seed(0)
    model = Outer().eval()
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops=["inner.a", "b"], tracer=tracer)
    torch.testing.assert_close(tapped(x), model(x))
    if tracer != "dynamo":  # (under dynamo a module with backward hooks is no site: loud)
        model.b.register_full_backward_hook(lambda *a: None)  # its bookkeeping: followed
        torch.testing.assert_close(tapped(x), model(x))
    scale = model.inner.scale
    for change, undo in (
            (lambda: setattr(model.inner, "scale", 3.0),
             lambda: setattr(model.inner, "scale", scale)),
            (lambda: setattr(model.inner, "shift", 0.5),  # an instance attribute added
             lambda: delattr(model.inner, "shift"))):
        before = model(x)
        change()
        assert not torch.allclose(model(x), before)  # the model's values did change
        for _ in range(2):  # every call, not once
            with pytest.raises(UsageError, match=r"\('inner': (scale|shift)\)"):
                tapped(x)
        undo()
        torch.testing.assert_close(tapped(x), model(x))


@pytest.mark.parametrize("tracer", ["fx", "dynamo", "hooks"])
def test_attributes_put_back_as_equal_objects_are_followed(tracer: str) -> None:
    # torch.export puts a module's attributes back as equal new objects: that is no change
    # to refuse (it was refused for a timm ViT exported after tap()); the copy takes the
    # model's new objects, and a later real change is still refused.
    torch.manual_seed(0)
    model = Outer().eval()
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops=["inner.a", "b"], tracer=tracer)
    torch.testing.assert_close(tapped(x), model(x))
    a = model.inner.a
    a.padding_like = (1, 2)
    tapped = fxprobe.tap(model, ops=["inner.a", "b"], tracer=tracer)
    a.padding_like = tuple([1, 2])  # equal, not the same object
    torch.export.export(model, (x,))
    torch.testing.assert_close(tapped(x), model(x))
    assert vars(tapped.get_submodule("inner.a"))["padding_like"] is a.padding_like
    model.inner.scale = 2.0
    with pytest.raises(UsageError, match=r"\('inner': scale\)"):
        tapped(x)
