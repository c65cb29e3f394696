"""The ``tracer="auto"`` lifecycle (runtime/lifecycle.py): a fixed program, the states of each
module fx cannot trace (pending -> dynamo, or -> fallback), and what the tapped module reads."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
import zoo
from reference import hook_values
from torch import nn

import fxprobe


class Picky(nn.Module):
    """Not fx-traceable (a branch on a shape); raises the model's own error on one input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            raise ValueError("Picky wants a batch")
        return torch.tanh(self.lin(x)) * 2


class WithPicky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.picky = Picky()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.picky(self.stem(x)) + 1


def _states(tapped: fxprobe.TappedModule) -> dict[str, str]:
    return {path: str(state) for path, state in tapped._lifecycle().state.items()}


def test_the_program_stays_fixed_while_the_lifecycle_moves() -> None:
    torch._dynamo.reset()
    model, (x,), _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, ops=["stem", "gate.pos", "gate.neg.0", "head"])
    prog = tapped._program()
    fields = {f.name: getattr(prog, f.name) for f in dataclasses.fields(prog)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        prog.selected = ()  # type: ignore[misc]
    assert _states(tapped) == {"gate": "pending"}
    assert {s.name: s.how for s in tapped.sites}["gate.pos"] == "hook"  # known before a run
    with torch.no_grad():
        out = tapped(x)
        expected, ref = hook_values(model, ["stem", "head"], x)
    assert torch.equal(out, expected)
    for name, value in ref.items():
        assert torch.equal(tapped.taps[name], value), name
    assert _states(tapped) == {"gate": "dynamo"}
    assert tapped.fallbacks == ()  # dynamo captured the module fx could not trace
    assert tapped._program() is prog  # running built nothing, and changed nothing built
    assert {f.name: getattr(prog, f.name) for f in dataclasses.fields(prog)} == fields


def test_dynamo_failure_moves_to_the_fallback_with_its_reason(dynamo_fails: None) -> None:
    model, (x,), _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, ops=["gate.pos", "gate.neg.0"])
    with torch.no_grad():
        out = tapped(x)
        branch = "gate.pos" if model.stem(x).sum() > 0 else "gate.neg.0"
        expected, ref = hook_values(model, [branch], x)
    assert torch.equal(out, expected)
    assert torch.equal(tapped.taps[branch], ref[branch])
    assert _states(tapped) == {"gate": "fallback"}
    (fb,) = tapped.fallbacks
    assert "torch dynamo failed too" in fb.error and "dynamo fails here" in fb.error


def test_the_models_own_error_at_the_first_call_leaves_the_module_pending() -> None:
    torch._dynamo.reset()
    model = WithPicky().eval()
    tapped = fxprobe.tap(model, ops=["stem", "picky.lin"])
    with torch.no_grad(), pytest.raises(ValueError, match="Picky wants a batch"):
        tapped(torch.randn(1, 8))
    assert _states(tapped) == {"picky": "pending"}
    (fb,) = tapped.fallbacks
    assert "dynamo failed" not in fb.error  # the error was the model's, not dynamo's
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = tapped(x)
        expected, ref = hook_values(model, ["stem", "picky.lin"], x)
    assert torch.equal(out, expected)
    for name, value in ref.items():
        assert torch.equal(tapped.taps[name], value), name
    # Dynamo skips a frame it saw raise for good; fxprobe makes it capturable again
    # (frontends/dynamo_rearm.py): the next call is captured, its op-level sites kept.
    assert _states(tapped) == {"picky": "dynamo"}
    assert not tapped.fallbacks


def test_known_sites_lists_what_fx_hooks_and_then_dynamo_know() -> None:
    torch._dynamo.reset()
    model, (x,), _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, ops="head")
    assert tapped.known_sites() == fxprobe.sites(model)  # before a forward: fx and hooks
    with torch.no_grad():
        tapped(x)
    known = tapped.known_sites()
    assert known == fxprobe.sites(model, example_input=x)
    inside = {s.name: s.how for s in known.records if s.module_path.startswith("gate")}
    assert "dynamo" in inside.values()  # op-level sites inside the module fx could not trace
    assert [s.name for s in tapped.sites] == ["head"]  # the selection is not the listing


def _branch_input(model: nn.Module, sign: float) -> torch.Tensor:
    """An input whose gate takes the ``pos`` branch (``sign`` 1) or the ``neg`` one (-1)."""
    gen = torch.Generator().manual_seed(0)
    while True:
        x = torch.randn(3, 8, generator=gen)
        with torch.no_grad():
            if model.stem(x).sum() * sign > 0:
                return x


@pytest.mark.parametrize("eager_first", [False, True])
@pytest.mark.parametrize("first", [1.0, -1.0])
def test_compiled_auto_captures_hook_sites_whichever_branch_comes_first(
        first: float, eager_first: bool) -> None:
    # An outer torch.compile traces through the module fx could not trace: it runs as written,
    # and its hooks must be in place before the first compiled call reaches them.
    model, _, _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, ops=nn.Linear)
    torch._dynamo.reset()
    if eager_first:  # dynamo captured the module before the outer compile came
        with torch.no_grad():
            tapped(_branch_input(model, -first))
        assert _states(tapped) == {"gate": "dynamo"}
    compiled = torch.compile(tapped, backend="eager")
    for sign in (first, -first, first):
        x = _branch_input(model, sign)
        with torch.no_grad():
            got = compiled(x)
            expected, ref = hook_values(model, ["stem", "gate.pos", "gate.neg.0", "head"], x)
        assert torch.equal(got, expected)
        assert sorted(tapped.taps) == sorted(ref)
        for name, value in ref.items():
            assert torch.equal(tapped.taps[name], value), name
    assert _states(tapped) == {"gate": "fallback"}
    (fb,) = tapped.fallbacks
    assert "torch dynamo failed too" in fb.error and "outer torch.compile" in fb.error
    torch._dynamo.reset()


class Branchy(nn.Module):
    """Not fx-traceable (a branch on a value): under "auto" dynamo runs it, one graph per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Linear(4, 4)
        self.neg = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(x)
        if int(x.sum() > 0):
            return self.pos(x)
        return self.neg(x)


class WithBranchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.gate = Branchy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.stem(x)) * 2


@pytest.mark.parametrize("reduce", [None, "stats"])
def test_the_recompile_limit_is_never_silent(reduce: str | None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Past dynamo's recompile limit (new ranks and dtypes) the module runs as written: its
    module calls stay captured, equal to hooks at every call, and one warning names the
    module, dynamo's reason and the sites no longer captured."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 3)
    torch._dynamo.reset()  # dynamo counts the graphs of Branchy.forward's code of every tap
    torch.manual_seed(0)
    model = WithBranchy().eval()
    paths = ["stem", "gate.pos", "gate.neg"]
    kw = {} if reduce is None else {"reduce": reduce}
    tapped = fxprobe.tap(model, ops=[*paths, torch.tanh], **kw)
    inputs = [torch.randn(*[2] * rank, 4) for rank in range(1, 9)]
    inputs += [torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4).bfloat16()]
    late: list[str] = []
    for i, x in enumerate(inputs):
        model.to(x.dtype)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = tapped(x)
            expected, ref = hook_values(model, paths, x)
        late += [str(w.message) for w in caught if "recompile" in str(w.message)]
        assert torch.equal(out, expected), i
        taps = tapped.taps
        assert set(ref) <= set(taps.keys()), (i, sorted(taps.keys()))
        for name, value in ref.items():
            if reduce is None:
                assert torch.equal(taps[name], value), (i, name)
            else:
                assert taps[name].max == pytest.approx(float(value.double().max()), rel=1e-2)
        if _states(tapped) == {"gate": "dynamo"}:
            assert "gate.tanh" in taps.keys(), i
    assert _states(tapped) == {"gate": "fallback"}
    (message,) = late
    assert "'gate'" in message and "recompile_limit" in message
    assert "'gate.tanh'" in message and "hooks" in message


@pytest.mark.parametrize("same_disk", [False, True])
def test_nothing_is_written_before_the_selectors_are_checked(tmp_path: Path,
                                                            same_disk: bool) -> None:
    """Selectors are checked after dynamo's capture, at the end of the first forward: a
    forward whose selection fails commits nothing, so the corrected tap writes there."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = [torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(i))
           for i in range(2)]
    disk = fxprobe.Disk(tmp_path)
    bad = fxprobe.tap(model, ops="transformer.h.*.mpl", tracer="dynamo", to=disk)
    with torch.no_grad(), pytest.raises(fxprobe.SelectorError, match="mpl"):
        bad(input_ids=ids[0])
    assert disk.forwards == 0
    if not same_disk:  # a new Disk while the failed one is still open: it let go
        disk = fxprobe.Disk(tmp_path)
    paths = ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    with torch.no_grad(), fxprobe.tap(model, ops="transformer.h.*.mlp", tracer="dynamo",
                                      to=disk) as good:
        for x in ids:
            good(input_ids=x)
    caps = fxprobe.open_captures(tmp_path)
    assert len(caps) == 2
    for i, x in enumerate(ids):
        with torch.no_grad():
            _, ref = hook_values(model, paths, input_ids=x)
        got = caps.forward(i)
        assert sorted(got) == paths
        for name in paths:
            assert torch.equal(got[name], ref[name]), (i, name)
