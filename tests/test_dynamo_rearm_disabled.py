"""After the model raised while dynamo traced it, fxprobe lets dynamo capture the region's
code again (``frontends/dynamo_rearm.py``), but never a code the user or torch marked to be
skipped on purpose: a forward under ``torch.compiler.disable(recursive=False)`` (whose wrapper
code is one code object shared by every function so disabled in the process) or
``torch._dynamo.skip``. Before, the raise made dynamo compile every non-recursively disabled
function of the process, the user's own too, and the disabled forward inside the tapped model."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.decorators
import torch._dynamo.testing
from torch import nn

import fxprobe

COMPILED: list[bool] = []  # whether each call of a disabled body ran under dynamo


def _body(x: torch.Tensor) -> torch.Tensor:
    COMPILED.append(torch.compiler.is_compiling())
    return x.cos()


users_disabled = torch.compiler.disable(_body, recursive=False)


class Disabled(nn.Module):
    @torch.compiler.disable(recursive=False)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        COMPILED.append(torch.compiler.is_compiling())
        return x.sin()


class Skipped(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        COMPILED.append(torch.compiler.is_compiling())
        return x.tanh()


torch._dynamo.decorators.skip(Skipped.forward)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.off, self.skipped, self.fc2 = (
            nn.Linear(4, 4), Disabled(), Skipped(), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor, flag: bool = False) -> torch.Tensor:
        h = self.off(self.fc(x))
        if flag:
            raise ValueError("flag is not supported")
        return self.fc2(self.skipped(h))


def _users_function(x: torch.Tensor) -> torch.Tensor:
    return users_disabled(x + 1) * 2


def test_a_raise_leaves_disabled_and_skipped_codes_alone() -> None:
    torch.manual_seed(0)
    model = Model()
    tapped = fxprobe.tap(model, ops=["fc", "fc2"], tracer="dynamo")
    x = torch.randn(2, 4)
    with torch.no_grad():
        tapped(x)
        with pytest.raises(ValueError, match="flag is not supported"):
            tapped(x, flag=True)
        COMPILED.clear()
        for n in (2, 3):
            xs = torch.randn(n, 4)
            out = tapped(xs)
            torch.testing.assert_close(out, model(xs))
            torch.testing.assert_close(tapped.taps["fc"], model.fc(xs))
            torch.testing.assert_close(
                tapped.taps["fc2"], model.fc2(model.fc(xs).sin().tanh()))
        assert not any(COMPILED), "a disabled or skipped forward ran under dynamo"
        # the user's own compiled function: its disabled callee still runs as written
        counter = torch._dynamo.testing.CompileCounter()
        compiled = torch.compile(_users_function, backend=counter)
        COMPILED.clear()
        torch.testing.assert_close(compiled(x), (x + 1).cos() * 2)
        assert COMPILED == [False]
