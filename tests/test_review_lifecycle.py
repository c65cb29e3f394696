"""Review of the lifecycle merge (issue #26): silent wrong answers found by comparing the tapped
module with the model itself, eagerly, carrying the same hooks."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + 1


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Inner()
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * 2)


def _model() -> Outer:
    torch.manual_seed(0)
    return Outer().eval()


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def _double(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 2


def _add1(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out + 1


def _times3(mod: nn.Module, args: Any, kwargs: Any) -> Any:
    return (args[0] * 3,), kwargs


def _shift(mod: nn.Module, args: Any) -> Any:
    return (args[0] + 1,)


@pytest.mark.parametrize("tracer", ["auto", "fx", "dynamo", "hooks"])
@pytest.mark.parametrize("where", ["", "a", "a.lin", "b"])
def test_a_hook_prepended_on_the_model_after_tap_runs_first(tracer: str, where: str) -> None:
    # The copy appended the model's new hooks: prepend=True ran last, (out*2)+1 for (out+1)*2.
    model = _model()
    tapped = fxprobe.tap(model, ops="a" if tracer == "hooks" else "a.add", tracer=tracer)
    module = model.get_submodule(where)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "traced again" where the module was inlined
        module.register_forward_hook(_double)
        assert torch.equal(tapped(X), model(X))
        module.register_forward_hook(_add1, prepend=True)
        assert torch.equal(tapped(X), model(X))
        module.register_forward_pre_hook(_shift)
        module.register_forward_pre_hook(_times3, with_kwargs=True, prepend=True)
        assert torch.equal(tapped(X), model(X))


def test_the_tapped_modules_own_hooks_keep_their_place() -> None:
    model = _model()
    tapped = fxprobe.tap(model, ops="a.add")
    order: list[str] = []
    tapped.b.register_forward_hook(lambda m, a, o: order.append("own") or None)
    tapped.b.register_forward_hook(lambda m, a, o: order.append("own first") or None,
                                   prepend=True)
    model.b.register_forward_hook(lambda m, a, o: order.append("model") or None)
    model.b.register_forward_hook(lambda m, a, o: order.append("model first") or None,
                                  prepend=True)
    tapped(X)
    # Each keeps its own order (which of the two runs first is not the model's to say).
    assert [o for o in order if o.startswith("model")] == ["model first", "model"]
    assert [o for o in order if o.startswith("own")] == ["own first", "own"]


def _times3_inner(mod: nn.Module, args: Any, out: Any) -> Any:
    return out * 3 if isinstance(mod, Inner) else None


@pytest.mark.parametrize("tracer", ["auto", "fx", "dynamo"])
def test_a_global_module_hook_set_or_removed_after_tap_acts(tracer: str) -> None:
    # register_module_forward_hook runs for every module call: the graphs had inlined Inner's
    # forward (fx: with the hook as it was at trace time), so a change after tap() went unseen.
    from torch.nn.modules.module import register_module_forward_hook
    model = _model()
    tapped = fxprobe.tap(model, ops="a.add", tracer=tracer)
    plain = tapped(X)
    handle = register_module_forward_hook(_times3_inner)
    try:
        want = model(X)
        assert not torch.equal(want, plain)
        with pytest.warns(UserWarning, match="every module"):
            assert torch.equal(tapped(X), want)
    finally:
        handle.remove()
    with pytest.warns(UserWarning, match="every module"):
        assert torch.equal(tapped(X), plain)
    assert torch.equal(tapped.taps["a.add"], model.a(X))


class Tagged(nn.Module):
    """fx cannot trace it; dynamo splits it at a graph break, and the code after the break
    (its resume frame) is compiled again for every new value of ``tag`` (a str it guards on),
    while the frame before it is not."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        tag = str(round(float(h.sum()), 1))
        return torch.tanh(h) * len(tag)


class WithTagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.tagged = Tagged()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tagged(self.stem(x)) + 1


@pytest.mark.parametrize("tracer", ["auto", "dynamo"])
def test_a_resume_frame_past_the_recompile_limit_is_never_silent(
        tracer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The graph before the break kept running, so fxprobe saw graphs run: the resume frame ran
    # as written and 'tagged.tanh' was silently missing from the taps from then on.
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 3)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = WithTagged().eval()
    tapped = fxprobe.tap(model, ops=["stem", torch.tanh], tracer=tracer)
    said: list[str] = []
    for i in range(8):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = tapped(x)
            except fxprobe.DynamoError as e:  # tracer="dynamo": dynamo's failure is an error
                assert tracer == "dynamo" and "recompile_limit" in str(e)
                said.append(str(e))
                break
            want = model(x)
        said += [str(w.message) for w in caught if "recompile_limit" in str(w.message)]
        assert torch.equal(out, want), i
        assert torch.equal(tapped.taps["stem"], model.stem(x)), i
        if not said:
            assert torch.equal(tapped.taps["tagged.tanh"],
                               torch.tanh(model.tagged.lin(model.stem(x)))), i
    assert len(said) == 1, said
    if tracer == "auto":
        assert "'tagged'" in said[0] and "'tagged.tanh'" in said[0]


class Waits(nn.Module):
    """Calls ``self.wait()`` (run eagerly by dynamo) in the middle of its forward."""

    def __init__(self, wait: Any) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.wait = torch._dynamo.disable(wait)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.wait()
        return torch.tanh(h)


def test_two_threads_in_dynamo_regions_leave_dynamos_settings_as_they_were() -> None:
    # fxprobe makes dynamo raise at recompile_limit while its regions run (a setting of the
    # calling thread: dynamo's settings are thread-local). Interleaved (A in, B in, A out,
    # B out), the user's setting is back in both threads.
    import threading
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    torch.manual_seed(0)
    first = fxprobe.tap(Waits(lambda: a_in.set() or b_in.wait(10)), ops=torch.tanh,
                        tracer="dynamo")
    second = fxprobe.tap(Waits(lambda: b_in.set() or a_out.wait(10)), ops=torch.tanh,
                         tracer="dynamo")
    a_in.set(), b_in.set(), a_out.set()
    first(X), second(X)  # compiled: what follows compiles nothing
    a_in.clear(), b_in.clear(), a_out.clear()
    assert torch._dynamo.config.fail_on_recompile_limit_hit is False
    seen: list[bool] = []

    def run_second() -> None:
        a_in.wait(10)
        second(X)
        seen.append(torch._dynamo.config.fail_on_recompile_limit_hit)

    thread = threading.Thread(target=run_second)
    thread.start()
    try:
        first(X)
    finally:
        a_out.set()
        thread.join()
    assert torch._dynamo.config.fail_on_recompile_limit_hit is False and seen == [False]


@pytest.mark.parametrize("registered", ["before tap", "after tap"])
def test_a_pre_hooks_op_takes_no_site_name_under_dynamo(registered: str) -> None:
    # Dynamo traced the pre-hook's ``args[0] + 1`` inside a's call and named it 'a.add', so
    # ops='a.add' (the forward's ``+ 1``, as fx names it) silently captured the hook's sum.
    model = _model()
    if registered == "before tap":
        model.a.register_forward_pre_hook(_shift)
    tapped = fxprobe.tap(model, ops=["a.add", "a.lin"], tracer="dynamo")
    tapped(X)
    if registered == "after tap":
        model.a.register_forward_pre_hook(_shift)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # traced again
        out = tapped(X)
    lin = model.a.lin(X + 1)
    assert torch.equal(out, model(X))
    assert torch.equal(tapped.taps["a.lin"], lin)
    assert torch.equal(tapped.taps["a.add"], torch.relu(lin) + 1)
    assert sorted(tapped.taps.keys()) == ["a.add", "a.lin"]


@pytest.mark.parametrize("tracer", ["hooks", "auto", "dynamo"])
def test_a_module_call_site_is_what_the_call_returns_with_hooks_set_after_tap(
        tracer: str) -> None:
    # fxprobe's own capturing hook ran before the model's hooks carried over after tap(): the
    # site 'a' held the output before them (a hook set before tap() came first, as it should).
    model = _model()
    tapped = fxprobe.tap(model, ops="a", tracer=tracer)
    tapped(X)
    model.a.register_forward_hook(_double)
    model.a.register_forward_pre_hook(_shift)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = tapped(X)
    assert torch.equal(out, model(X))
    assert torch.equal(tapped.taps["a"], model.a(X))


def test_a_module_falling_back_at_its_second_call_in_a_forward_names_the_calls_after_the_first():
    """Inner runs twice in a forward; after a block whose edit raised, past the recompile
    limit, dynamo fails at the second call, after it captured the first: the hooks that run the
    second call as written name its values inner.fc_2 and inner.fc_3. They took inner.fc and
    inner.fc_1 again, the first call's names, showing the second call's values under them."""
    from life_models import twice

    torch._dynamo.reset()
    model = twice()
    x = torch.randn(4)
    ref = copy.deepcopy(model)
    seen: list[torch.Tensor] = []
    ref.inner.fc.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    with torch.no_grad():
        want = ref(x)
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tapped = fxprobe.tap(model, ops=nn.Linear, tracer="auto")

        def boom(site: Any, value: Any) -> Any:
            raise RuntimeError("an edit that raises")

        with pytest.raises(RuntimeError), tapped.intervene({"inner.fc_1": boom}):
            tapped(torch.randn(3, 4))
        out = tapped(x)  # the second call of inner needs a third compiled entry: the limit
    assert tapped.fallbacks, "the recompile limit was not reached: the test tests nothing"
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    names = ["inner.fc", "inner.fc_1", "inner.fc_2", "inner.fc_3"]
    assert [n for n in tapped.taps if n.startswith("inner.")] == names
    for name, value in zip(names, seen, strict=True):
        torch.testing.assert_close(tapped.taps[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("when", ["before tap", "after tap"])
def test_a_model_hook_that_keeps_a_copy_leaves_the_module_call_site_its_value(when):
    """A forward hook that keeps ``out.detach().clone()`` (the common recording hook) inside a
    dynamo region: its copy leaves the graph only (dynamo replays the append), so it is not
    the call's output. Taken for it, the first inner.fc call of each graph had no site and the
    names shifted: inner.fc showed the second call's value."""
    from life_models import twice

    torch._dynamo.reset()
    model = twice()
    x = torch.randn(4)
    seen: list[torch.Tensor] = []
    ref = copy.deepcopy(model)
    ref.inner.fc.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    with torch.no_grad():
        want = ref(x)
    expected = seen
    kept: list[torch.Tensor] = []

    def keep(m: nn.Module, args: Any, out: torch.Tensor) -> None:
        kept.append(out.detach().clone())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if when == "before tap":
            model.inner.fc.register_forward_hook(keep)
        tapped = fxprobe.tap(model, ops=nn.Linear, tracer="dynamo")
        if when == "after tap":
            model.inner.fc.register_forward_hook(keep)
        out = tapped(x)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    names = ["inner.fc", "inner.fc_1", "inner.fc_2", "inner.fc_3"]
    assert [n for n in tapped.taps if n.startswith("inner.")] == names
    for name, value in zip(names, expected, strict=True):
        torch.testing.assert_close(tapped.taps[name], value, rtol=0, atol=0)
    assert len(kept) == 4  # the model's hook ran at each call


def test_a_second_tap_past_the_recompile_limit_at_its_first_call_is_never_silent():
    """The resume frames after a graph break are the model's own code, whose compiled entries
    every tap of the model in the process shares: a later tap can meet the recompile limit at
    its first call. Its ops then go uncaptured (inner.relu): said once, not silent."""
    from life_models import twice

    torch._dynamo.reset()
    model = twice()
    x = torch.randn(3, 4)
    ref = copy.deepcopy(model)
    seen: list[torch.Tensor] = []
    ref.inner.fc.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    with torch.no_grad():
        want = ref(x)
    with torch._dynamo.config.patch(recompile_limit=1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first = fxprobe.tap(model, ops=[nn.Linear, torch.relu], tracer="auto")
            first(x)
            first.remove()
        tapped = fxprobe.tap(model, ops=[nn.Linear, torch.relu], tracer="auto")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = tapped(x)
    said = [str(w.message) for w in caught if "recompile_limit" in str(w.message)]
    assert len(said) == 1 and "at its first call" in said[0], [str(w.message) for w in caught]
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    names = ["inner.fc", "inner.fc_1", "inner.fc_2", "inner.fc_3"]
    for name, value in zip(names, seen, strict=True):
        torch.testing.assert_close(tapped.taps[name], value, rtol=0, atol=0)
