"""The core contract of fxprobe.tap against eager outputs and hook-cloned references."""

from __future__ import annotations

import pytest
import torch
import zoo
from reference import hook_values, model_state, same, states_equal
from torch import nn

import fxprobe


@pytest.mark.parametrize("name", sorted(zoo.ALL_MODELS))
def test_tapping_every_site_leaves_output_bitwise_unchanged(name: str) -> None:
    model, args, kwargs = zoo.make(name)
    with torch.no_grad():
        expected = model(*args, **kwargs)
        tapped = fxprobe.tap(model)
        got = tapped(*args, **kwargs)
    assert same(got, expected)
    assert len(tapped.taps) > 0


@pytest.mark.parametrize("name", sorted(zoo.ALL_MODELS))
def test_model_untouched_by_tap_forward_and_remove(name: str) -> None:
    model, args, kwargs = zoo.make(name)
    before = model_state(model)
    with torch.no_grad():
        expected = model(*args, **kwargs)
        tapped = fxprobe.tap(model)
        tapped(*args, **kwargs)
        tapped.train()
        tapped(*args, **kwargs) if name not in ("resnet", "inplace") else None
        tapped.eval()
        assert states_equal(before, model_state(model))
        tapped.remove()
        assert states_equal(before, model_state(model))
        assert same(model(*args, **kwargs), expected)


@pytest.mark.parametrize("name", ["resnet", "encoder", "lstm", "shared", "multi_io", "inplace"])
def test_module_sites_match_hooks_that_clone(name: str) -> None:
    model, args, kwargs = zoo.make(name)
    tapped = fxprobe.tap(model, ops=nn.Module)
    paths = sorted({s.target for s in tapped.sites})
    with torch.no_grad():
        _, ref = hook_values(model, paths, *args, **kwargs)
        tapped(*args, **kwargs)
    assert set(tapped.taps) == set(ref)
    for key, value in ref.items():
        assert same(tapped.taps[key], value), key


def test_functional_sites_match_hand_computed_values() -> None:
    model, (x,), _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, ops=[torch.flatten, "layer1.0.add", "avgpool"])
    with torch.no_grad():
        out = tapped(x)
        m = model
        h = m.maxpool(m.relu(m.bn1(m.conv1(x))))
        b = m.layer1[0]
        add = b.bn2(b.conv2(b.relu(b.bn1(b.conv1(h))))) + h
        assert torch.equal(tapped.taps["layer1.0.add"], add)
        flat = torch.flatten(tapped.taps["avgpool"], 1)
        assert torch.equal(tapped.taps["flatten"], flat)
        assert torch.equal(out, m.fc(flat))


def test_parameters_are_shared_and_training_trains_the_model() -> None:
    model, (x,), _ = zoo.make("encoder")
    tapped = fxprobe.tap(model, ops="fc1")
    assert [id(p) for p in tapped.parameters()] == [id(p) for p in model.parameters()]
    assert list(tapped.state_dict()) == list(model.state_dict())
    before = model.fc1.weight.detach().clone()
    opt = torch.optim.SGD(tapped.parameters(), lr=0.1)
    tapped(x).sum().backward()
    opt.step()
    assert not torch.equal(model.fc1.weight, before)


def test_train_and_eval_graphs_follow_the_mode() -> None:
    model, (x,), _ = zoo.make("train_eval")
    tapped = fxprobe.tap(model, ops=[nn.Linear, torch.sigmoid, torch.relu])
    assert [s.name for s in tapped.sites] == ["fc1", "sigmoid", "fc2"]
    with torch.no_grad():
        assert torch.equal(tapped(x), model(x))
        assert "sigmoid" in tapped.taps
        tapped.train()
        assert model.training is False  # the model's own flag is not touched
        torch.manual_seed(1)
        got = tapped(x)
        model.train()
        torch.manual_seed(1)
        expected = model(x)
        model.eval()
    assert torch.equal(got, expected)
    assert [s.name for s in tapped.sites] == ["fc1", "relu", "fc2"]
    assert set(tapped.taps) == {"fc1", "relu", "fc2"}


def test_last_forward_replaces_values() -> None:
    model, (x,), _ = zoo.make("shared")
    tapped = fxprobe.tap(model, ops=nn.Linear)
    with torch.no_grad():
        tapped(x)
        first = tapped.taps["fc"]
        tapped(x * 2)
    assert not torch.equal(first, tapped.taps["fc"])
    assert torch.equal(tapped.taps["fc"], model.fc(x * 2))
    assert list(tapped.taps) == ["fc", "fc_1", "out"]


def test_capture_input_and_both() -> None:
    model, (x,), _ = zoo.make("shared")
    t_in = fxprobe.tap(model, ops="out", capture="input")
    t_both = fxprobe.tap(model, ops="out", capture="both")
    with torch.no_grad():
        t_in(x)
        t_both(x)
        h = model.fc(torch.relu(model.fc(x)))
    (inp,) = t_in.taps["out"]
    assert torch.equal(inp, h)
    both = t_both.taps["out"]
    assert isinstance(both, fxprobe.InOut)
    assert torch.equal(both.inputs[0], h) and torch.equal(both.output, model.out(h))


def test_capture_input_sees_value_before_an_inplace_module() -> None:
    model, (x,), _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, ops="relu", capture="input")
    with torch.no_grad():
        tapped(x)
        expected = model.bn1(model.conv1(x))
    assert torch.equal(tapped.taps["relu"][0], expected)
    assert (expected < 0).any()  # the ReLU would have changed it


def test_nested_outputs_keep_their_structure() -> None:
    model, (ids,), _ = zoo.make("lstm")
    tapped = fxprobe.tap(model, ops=nn.LSTM)
    with torch.no_grad():
        tapped(ids)
        out, (h, c) = model.lstm(model.embed(ids))
    value = tapped.taps["lstm"]
    assert isinstance(value, tuple) and isinstance(value[1], tuple)
    assert same(value, (out, (h, c)))


def test_detach_default_and_detach_false_keeps_the_graph() -> None:
    model, (x,), _ = zoo.make("encoder")
    tapped = fxprobe.tap(model, ops="fc1")
    tapped(x)
    assert tapped.taps["fc1"].grad_fn is None
    live = fxprobe.tap(model, ops="fc1", detach=False)
    live(x)
    hidden = live.taps["fc1"]
    assert hidden.grad_fn is not None
    (grad,) = torch.autograd.grad(hidden.pow(2).sum(), model.fc1.weight)
    assert grad.abs().sum() > 0


def test_multiple_inputs_keyword_arguments_and_dict_output() -> None:
    model, args, kwargs = zoo.make("multi_io")
    tapped = fxprobe.tap(model, ops=["a", "a_1", "scale", "mul"])
    with torch.no_grad():
        out = tapped(*args, scale=3.0)
        expected = model(*args, scale=3.0)
    assert isinstance(out, dict) and same(out, expected)
    assert tapped.taps["scale"] == 3.0
    assert torch.equal(tapped.taps["a"], model.a(args[0]))
    assert torch.equal(tapped.taps["a_1"], model.a(args[0]))


def test_context_manager_removes_on_exception(dynamo_fails: None) -> None:
    model, (x,), _ = zoo.make("data_dependent")
    before = model_state(model)
    with pytest.raises(RuntimeError, match="boom"):
        with fxprobe.tap(model, ops=nn.Linear) as tapped:
            tapped(x)
            assert tapped._state.hookset.handles
            raise RuntimeError("boom")
    assert not tapped._state.hookset.handles
    assert all(not m.__dict__.get("forward") for m in tapped._state.root.modules())
    assert states_equal(before, model_state(model))
    with pytest.raises(fxprobe.RemovedError):
        tapped(x)
    assert "stem" in tapped.taps  # what was captured stays readable


def test_original_model_call_records_nothing() -> None:
    model, (x,), _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, ops=nn.Linear)
    with torch.no_grad():
        tapped(x)
        kept = dict(tapped.taps)
        model(x * 5)
        tapped.gate(x * 5)  # a submodule of the tapped module outside a tapped forward
    assert set(tapped.taps) == set(kept)
    assert all(torch.equal(tapped.taps[k], v) for k, v in kept.items())


def test_copy_policies() -> None:
    model, (x,), _ = zoo.make("resnet")
    never = fxprobe.tap(model, ops="bn1", copy="never")
    always = fxprobe.tap(model, ops="fc", copy="always")
    with torch.no_grad():
        never(x)
        always(x)
        bn = model.bn1(model.conv1(x))
    # Without a copy, the in-place ReLU that follows overwrote the captured BatchNorm output.
    assert torch.equal(never.taps["bn1"], torch.relu(bn))
    assert always.graphs[""] is not None
    assert any("clone" in str(n.target) for n in always.graphs[""].nodes)


def test_deepcopy_gives_an_independent_tapped_module() -> None:
    import copy

    model, (x,), _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, ops=nn.Linear)
    twin = copy.deepcopy(tapped)
    with torch.no_grad():
        twin(x)
        assert len(tapped.taps) == 0 and len(twin.taps) > 0
        assert torch.equal(twin.taps["stem"], model.stem(x))
        tapped(x * 2)
        assert torch.equal(twin.taps["stem"], model.stem(x))
    assert all(p is not q for p, q in zip(twin.parameters(), model.parameters(), strict=True))


def test_a_compiled_model_is_tapped_through_the_module_it_compiles() -> None:
    model, (x,), _ = zoo.make("resnet")
    compiled = torch.compile(model)
    with pytest.warns(UserWarning, match="_orig_mod"):
        tapped = fxprobe.tap(compiled, ops=["layer1.0.add", "fc"])
    assert [s.name for s in tapped.sites] == ["layer1.0.add", "fc"]
    with pytest.warns(UserWarning, match="_orig_mod"):
        assert fxprobe.sites(model) == fxprobe.sites(compiled)
    with torch.no_grad():
        out = tapped(x)
        _, ref = hook_values(model, ["fc"], x)
    assert torch.equal(out, model(x)) and torch.equal(tapped.taps["fc"], ref["fc"])


def test_tapping_a_tapped_module_is_refused_with_the_fix() -> None:
    model, _, _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, ops="fc")
    with pytest.raises(fxprobe.UnsupportedModelError, match="tap the original model"):
        fxprobe.tap(tapped, ops="bn1")


@pytest.mark.parametrize("tracer", ["fx", "hooks"])
def test_each_thread_reads_the_values_of_its_own_last_forward(tracer: str) -> None:
    import threading

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    tapped = fxprobe.tap(model, ops=["0", "2"], tracer=tracer)
    inputs = [torch.randn(2, 8) for _ in range(4)]
    with torch.no_grad():
        expected = [(model[0](x), model(x)) for x in inputs]
    wrong: list[int] = []
    barrier = threading.Barrier(len(inputs))

    def work(i: int) -> None:
        barrier.wait()
        with torch.no_grad():
            for _ in range(300):
                tapped(inputs[i])
                first, last = tapped.taps["0"], tapped.taps["2"]
                if not (torch.equal(first, expected[i][0]) and torch.equal(last, expected[i][1])):
                    wrong.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # however long a loaded machine takes
    assert not any(t.is_alive() for t in threads)
    assert wrong == []
