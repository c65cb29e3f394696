"""Review of dynamo graphs with an intervention point at each selected site: a per-call block
(``intervene``, ``run_with_cache``) on sites ``tap()`` selected runs the graph ``tap()`` built;
a block on any other site runs the version with a point at every site. Every call is checked
against forward hooks that clone on an untapped copy, and the two versions against each
other: sequences that alternate them, nested blocks, threads, ``capture="input"``/``"both"``,
``tap(fn=)``, an in-place op after a selected site, a module called twice, gradients through
an edit, the pattern beside SDPA."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe

transformers = pytest.importorskip("transformers")

Edit = Callable[[torch.Tensor], torch.Tensor]


def _gpt2(**kw: Any) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0, **kw)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


MODELS = {"gpt2": (_gpt2, "transformer.h"), "llama": (_llama, "model.layers")}


def _reference(model: nn.Module, x: torch.Tensor, edits: dict[str, Edit],
               keep: tuple[str, ...] = ()) -> tuple[torch.Tensor, dict[str, Any]]:
    """The logits of an untapped copy whose modules at the paths in ``edits`` have their output
    replaced by forward hooks, and the (edited) output of each module in ``keep``, cloned."""
    ref = copy.deepcopy(model)
    seen: dict[str, Any] = {}
    handles = [ref.get_submodule(p).register_forward_hook(lambda m, i, o, fn=fn: fn(o))
               for p, fn in edits.items()]
    handles += [ref.get_submodule(p).register_forward_hook(
        lambda m, i, o, p=p: seen.__setitem__(p, o.detach().clone())) for p in keep]
    with torch.no_grad():
        logits = ref(x).logits
    for h in handles:
        h.remove()
    return logits, seen


def _steer(v: torch.Tensor) -> torch.Tensor:
    return v + torch.linspace(-1, 1, v.shape[-1])


def _half(v: torch.Tensor) -> torch.Tensor:
    return v * 0.5


def _fn(edit: Edit) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    return lambda site, v: edit(v)


@pytest.mark.parametrize(("family", "tracer"), [("gpt2", "dynamo"), ("llama", "auto")])
@torch.no_grad()
def test_blocks_alternate_between_selected_and_other_sites_across_lengths(
        family: str, tracer: str) -> None:
    make, h = MODELS[family]
    model = make()
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer=tracer)
    keep = (f"{h}.0", f"{h}.1")
    for length in (5, 3):
        x = torch.randint(1, 100, (2, length))
        steps: list[tuple[dict[str, Any], dict[str, Edit]]] = [
            ({"blocks.0.resid_post": _fn(_steer)}, {f"{h}.0": _steer}),
            ({f"{h}.1.mlp": _fn(_half)}, {f"{h}.1.mlp": _half}),
            ({}, {}),
            ({"blocks.1.resid_post": _fn(_half), f"{h}.0.mlp": lambda s, v: None},
             {f"{h}.1": _half}),
            ({"blocks.1.resid_post": _fn(_half)}, {f"{h}.1": _half}),
        ]
        for i, (fns, edits) in enumerate(steps):
            want, seen = _reference(model, x, edits, keep)
            if fns:
                with tapped.intervene(fns):
                    out = tapped(x).logits
            else:
                out = tapped(x).logits
            torch.testing.assert_close(out, want, msg=f"{length} step {i}")
            for n in range(2):  # the taps keep what flowed on, after the edit
                torch.testing.assert_close(tapped.taps[f"blocks.{n}.resid_post"],
                                           seen[f"{h}.{n}"], msg=f"{length} step {i} {n}")
        plain, seen = _reference(model, x, {}, (f"{h}.1", f"{h}.0.mlp"))
        for names, path in [("blocks.1.resid_post", f"{h}.1"), (f"{h}.0.mlp", f"{h}.0.mlp"),
                            ("blocks.1.resid_post", f"{h}.1")]:
            out, cache = tapped.run_with_cache(x, names=names)
            torch.testing.assert_close(out.logits, plain)
            assert list(cache) and len(cache) == 1, list(cache)
            torch.testing.assert_close(cache[names], seen[path], msg=names)


@torch.no_grad()
def test_nested_blocks_one_on_a_selected_site_one_on_another() -> None:
    model = _gpt2()
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    sel = ("blocks.0.resid_post", "transformer.h.0", _steer)
    other = ("transformer.h.1.mlp", "transformer.h.1.mlp", _half)
    for outer, inner in [(sel, other), (other, sel)]:
        _nested(tapped, model, torch.randint(1, 100, (1, 6)), outer, inner)


def _nested(tapped: Any, model: nn.Module, x: torch.Tensor, outer: tuple[str, str, Edit],
            inner: tuple[str, str, Edit]) -> None:
    both = {outer[1]: outer[2], inner[1]: inner[2]}
    with tapped.intervene({outer[0]: _fn(outer[2])}):
        torch.testing.assert_close(tapped(x).logits,
                                   _reference(model, x, {outer[1]: outer[2]})[0])
        with tapped.intervene({inner[0]: _fn(inner[2])}):
            want, seen = _reference(model, x, both, ("transformer.h.1",))
            torch.testing.assert_close(tapped(x).logits, want)
            _, cache = tapped.run_with_cache(x, names="blocks.1.resid_post")
            torch.testing.assert_close(cache["blocks.1.resid_post"], seen["transformer.h.1"])
        torch.testing.assert_close(tapped(x).logits,
                                   _reference(model, x, {outer[1]: outer[2]})[0])
    torch.testing.assert_close(tapped(x).logits, _reference(model, x, {})[0])


@pytest.mark.parametrize(("site", "tracer"), [("blocks.0.resid_post", "dynamo"),
                                             ("transformer.h.1.mlp", "auto")])
def test_a_thread_in_a_block_does_not_edit_another_threads_plain_calls(
        site: str, tracer: str) -> None:
    model = _gpt2()
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer=tracer)
    x = torch.randint(1, 100, (2, 6))
    path = "transformer.h.0" if site.startswith("blocks") else site
    edited, _ = _reference(model, x, {path: _steer})
    plain, _ = _reference(model, x, {})
    with torch.no_grad():
        tapped(x)  # the first forward captures; then both threads run the captured graphs
    start = threading.Barrier(2)
    wrong: list[str] = []

    def in_block() -> None:
        with torch.no_grad(), tapped.intervene({site: _fn(_steer)}):
            start.wait()
            for i in range(6):
                if not torch.allclose(tapped(x).logits, edited, atol=1e-5):
                    wrong.append(f"edited call {i}")

    def plain_calls() -> None:
        start.wait()
        with torch.no_grad():
            for i in range(6):
                if not torch.allclose(tapped(x).logits, plain, atol=1e-5):
                    wrong.append(f"plain call {i}")

    threads = [threading.Thread(target=in_block), threading.Thread(target=plain_calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, wrong


def _force_every_point(fns: dict[str, Any]) -> dict[str, Any]:
    """``fns`` and a function that leaves an unselected site as it is: the same edits, run by
    the version with a point at every site."""
    return {**fns, "transformer.h.1.mlp": lambda s, v: None}


@pytest.mark.parametrize("capture", ["input", "both"])
@torch.no_grad()
def test_capture_input_or_both_with_a_block_on_the_selected_site(capture: str) -> None:
    model = _gpt2()
    tapped = fxprobe.tap(model, ops="transformer.h.0.mlp", tracer="dynamo", capture=capture)
    ref = copy.deepcopy(model)
    seen: dict[str, torch.Tensor] = {}
    mlp = ref.transformer.h[0].mlp
    mlp.register_forward_pre_hook(lambda m, a: seen.__setitem__("in", a[0].detach().clone()))
    mlp.register_forward_hook(lambda m, a, o: o * 2.0)
    for length, every_point in [(4, False), (7, True), (5, False)]:
        x = torch.randint(1, 100, (2, length))
        fns: dict[str, Any] = {"transformer.h.0.mlp": lambda s, v: v * 2.0}
        with tapped.intervene(_force_every_point(fns) if every_point else fns):
            out = tapped(x).logits
        want = ref(x).logits
        torch.testing.assert_close(out, want)
        kept = tapped.taps["transformer.h.0.mlp"]
        if capture == "input":  # the inputs, as a tuple
            torch.testing.assert_close(kept[0], seen["in"])
        else:
            torch.testing.assert_close(kept.inputs[0], seen["in"])
            plain_mlp = model.transformer.h[0].mlp(seen["in"])
            torch.testing.assert_close(kept.output, plain_mlp * 2.0)  # what flowed on
        torch.testing.assert_close(tapped(x).logits, _reference(model, x, {})[0])


@torch.no_grad()
def test_tap_fn_and_a_block_on_the_same_site_in_either_version() -> None:
    """The per-call function first, then ``fn=`` on what it returned (as documented)."""
    model = _gpt2()
    tapped = fxprobe.tap(model, ops="blocks.0.resid_post", tracer="auto",
                         fn=lambda s, v: v + 1.0)
    x = torch.randint(1, 100, (1, 5))
    fns: dict[str, Any] = {"blocks.0.resid_post": lambda s, v: v * 2.0}
    for every_point in (False, True, False):
        with tapped.intervene(_force_every_point(fns) if every_point else fns):
            out = tapped(x).logits
        torch.testing.assert_close(
            out, _reference(model, x, {"transformer.h.0": lambda v: v * 2.0 + 1.0})[0])
        torch.testing.assert_close(
            tapped(x).logits, _reference(model, x, {"transformer.h.0": lambda v: v + 1.0})[0])


class InPlace(nn.Module):
    """A Linear whose output a ReLU(inplace=True) overwrites, then a Linear called twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.act, self.out = nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.out(self.act(self.fc(x))))


def _inplace_reference(model: nn.Module, x: torch.Tensor, edit: dict[int, Edit]
                       ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(output, fc's output before the ReLU writes it, each call of ``out``) of a copy whose
    ``out`` call number k (0, 1) has its output replaced by ``edit[k]``."""
    ref = copy.deepcopy(model)
    fc: list[torch.Tensor] = []
    calls: list[torch.Tensor] = []
    ref.fc.register_forward_hook(lambda m, a, o: fc.append(o.detach().clone()))

    def on_out(m: nn.Module, a: Any, o: torch.Tensor) -> torch.Tensor:
        o = edit.get(len(calls), lambda v: v)(o)
        calls.append(o.detach().clone())
        return o

    ref.out.register_forward_hook(on_out)
    with torch.no_grad():
        y = ref(x)
    return y, fc[0], calls


@pytest.mark.parametrize("tracer", ["dynamo", "auto"])
@torch.no_grad()
def test_an_in_place_op_after_a_selected_site_and_a_module_called_twice(tracer: str) -> None:
    model = InPlace().eval()
    tapped = fxprobe.tap(model, ops=["fc", "out"], tracer=tracer)
    less: Edit = lambda v: v - 0.25  # noqa: E731  (more negatives: the ReLU changes them)
    for rows in (3, 5):
        x = torch.randn(rows, 8)
        y, fc, _ = _inplace_reference(model, x, {})
        out, cache = tapped.run_with_cache(x, names="fc")
        torch.testing.assert_close(out, y)
        assert (fc < 0).any()
        torch.testing.assert_close(cache["fc"], fc)  # before the ReLU wrote it
        torch.testing.assert_close(tapped.taps["fc"], fc)
        # fc edited (selected; the ReLU then writes into what the edit returned) and the
        # first call of out (selected; "out" names it, the second is "out_1")
        ref = copy.deepcopy(model)
        kept: list[torch.Tensor] = []
        ref.fc.register_forward_hook(lambda m, a, o: less(o))
        ref.fc.register_forward_hook(lambda m, a, o, kept=kept: kept.append(o.detach().clone()))
        calls: list[int] = []

        def first_call(m: nn.Module, a: Any, o: torch.Tensor, calls: list[int] = calls
                       ) -> torch.Tensor | None:
            calls.append(1)
            return less(o) if len(calls) == 1 else None

        ref.out.register_forward_hook(first_call)
        with tapped.intervene({"fc": _fn(less), "out": _fn(less)}):
            out = tapped(x)
        torch.testing.assert_close(out, ref(x))
        torch.testing.assert_close(tapped.taps["fc"], kept[0])  # the edit, before the ReLU
        with tapped.intervene({"out_1": _fn(_half)}):  # the second call, not selected
            out = tapped(x)
        y, _, seen = _inplace_reference(model, x, {1: _half})
        torch.testing.assert_close(out, y)
        torch.testing.assert_close(tapped.taps["out"], seen[0])
        torch.testing.assert_close(tapped(x), _inplace_reference(model, x, {})[0])


def test_training_gradients_through_an_edit_on_a_selected_site_equal_hooks() -> None:
    model = _gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()
    ref = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    edit: Edit = lambda v: v * v.sigmoid() + 0.1  # noqa: E731
    fns: dict[str, Any] = {"blocks.0.resid_post": _fn(edit)}
    for length, every_point in [(4, False), (6, True), (5, False)]:
        emb = torch.randn(2, length, 32)
        for edited in (True, False):
            x, x_ref = emb.clone().requires_grad_(), emb.clone().requires_grad_()
            model.zero_grad()
            ref.zero_grad()
            if edited:
                with tapped.intervene(_force_every_point(fns) if every_point else fns):
                    tapped(inputs_embeds=x).logits.pow(2).mean().backward()
                hook = ref.transformer.h[0].register_forward_hook(lambda m, a, o: edit(o))
            else:
                tapped(inputs_embeds=x).logits.pow(2).mean().backward()
                hook = None
            ref(inputs_embeds=x_ref).logits.pow(2).mean().backward()
            if hook is not None:
                hook.remove()
            assert x.grad is not None and x_ref.grad is not None
            torch.testing.assert_close(x.grad, x_ref.grad, msg=f"{length} {edited}")
            w, w_ref = (m.transformer.h[0].attn.c_attn.weight.grad for m in (model, ref))
            torch.testing.assert_close(w, w_ref, msg=f"{length} {edited}")


@torch.no_grad()
def test_the_pattern_beside_sdpa_selected_has_no_base_point_and_its_edit_drives_attention(
        ) -> None:
    """An edit of the pattern (each position attends to itself only) must reach the attention
    output: there the heads' values, merged, go into the output projection (by hand)."""
    model = _gpt2()
    tapped = fxprobe.tap(model, ops="blocks.*.attn.pattern", tracer="dynamo")
    ref = copy.deepcopy(model)
    kept: dict[str, torch.Tensor] = {}
    attn = ref.transformer.h[0].attn
    attn.c_attn.register_forward_hook(lambda m, a, o: kept.__setitem__("v", o[..., 64:]))
    hook = attn.c_proj.register_forward_pre_hook(lambda m, a: (kept["v"],))
    for length in (5, 3):
        x = torch.randint(1, 100, (2, length))

        def itself(site: Any, p: torch.Tensor) -> torch.Tensor:
            return torch.eye(p.shape[-1]).expand_as(p).clone()

        for fns in ({"blocks.0.attn.pattern": itself},
                    {"blocks.0.attn.pattern": itself, "blocks.1.resid_post": lambda s, v: None}):
            with tapped.intervene(fns):
                out = tapped(x).logits
            torch.testing.assert_close(out, ref(x).logits)
            assert torch.equal(tapped.taps["blocks.0.attn.pattern"][0, 0], torch.eye(length))
        hook.remove()
        plain = ref(x, output_attentions=False).logits
        torch.testing.assert_close(tapped(x).logits, plain)
        _, cache = tapped.run_with_cache(x, names="blocks.1.attn.pattern")
        torch.testing.assert_close(cache["blocks.1.attn.pattern"],
                                   tapped.taps["blocks.1.attn.pattern"])
        hook = attn.c_proj.register_forward_pre_hook(lambda m, a: (kept["v"],))
    hook.remove()


def test_grads_of_a_selected_site_edited_in_a_block_equal_hooks() -> None:
    """``grad=True``: the gradient kept for the edited site is the loss's gradient with respect
    to the value that flowed on (the edit's result), as a hook's ``retain_grad`` sees it."""
    model = _gpt2()
    ref = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo", grad=True)
    edit: Edit = lambda v: v * 1.5 - 0.2  # noqa: E731
    fns: dict[str, Any] = {"blocks.0.resid_post": _fn(edit)}
    kept: dict[str, torch.Tensor] = {}

    def keep(m: nn.Module, a: Any, o: torch.Tensor) -> torch.Tensor:
        o = edit(o)
        o.retain_grad()
        kept["o"] = o
        return o

    ref.transformer.h[0].register_forward_hook(keep)
    for length, every_point in [(4, False), (7, True), (5, False)]:
        x = torch.randint(1, 100, (2, length))
        with tapped.intervene(_force_every_point(fns) if every_point else fns):
            tapped(x).logits.pow(2).mean().backward()
        ref(x).logits.pow(2).mean().backward()
        torch.testing.assert_close(tapped.grads["blocks.0.resid_post"], kept["o"].grad)
        model.zero_grad()


class Twice(nn.Module):
    """A block whose code dynamo captures as a graph of its own (a graph break around it),
    called twice: its second run is a version of its own (``fc_1``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        torch._dynamo.graph_break()
        return self.out(y + self.fc(y))


@torch.no_grad()
def test_a_module_called_twice_across_a_graph_break_edits_only_the_named_call() -> None:
    model = Twice()
    tapped = fxprobe.tap(model, ops="fc", tracer="dynamo")
    for rows in (3, 6, 3):
        x = torch.randn(rows, 8)
        for name, which in [("fc", 0), ("fc_1", 1), ("fc", 0)]:
            ref = copy.deepcopy(model)
            calls: list[int] = []
            ref.fc.register_forward_hook(
                lambda m, a, o, calls=calls, which=which:
                (calls.append(1), o * 3 if len(calls) == which + 1 else None)[1])
            with tapped.intervene({name: lambda s, v: v * 3}):
                out = tapped(x)
            torch.testing.assert_close(out, ref(x), msg=f"{rows} {name}")
        torch.testing.assert_close(tapped(x), model(x))


def _uniform_reference(model: nn.Module) -> nn.Module:
    """A copy whose first attention attends to every position alike (scores all zero, no
    mask): its output is the mean of the values over positions, by hand."""
    ref = copy.deepcopy(model)
    kept: dict[str, torch.Tensor] = {}
    attn = ref.transformer.h[0].attn
    attn.c_attn.register_forward_hook(lambda m, a, o: kept.__setitem__("v", o[..., 64:]))
    attn.c_proj.register_forward_pre_hook(
        lambda m, a: (kept["v"].mean(1, keepdim=True).expand_as(kept["v"]).contiguous(),))
    return ref


def _zero(site: Any, v: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(v)


@torch.no_grad()
def test_an_edit_of_the_scores_beside_sdpa_selected_drives_the_attention() -> None:
    """With the scores selected at tap(), a block on them ran the graph tap() built, where
    the scores beside SDPA are computed aside: the edit was silently ignored (the version
    with every point applied it)."""
    model = _gpt2()
    ref = _uniform_reference(model)
    tapped = fxprobe.tap(model, ops="blocks.*.attn.scores", tracer="dynamo")
    fns: dict[str, Any] = {"blocks.0.attn.scores": _zero}
    for length, every_point in [(5, False), (3, True), (4, False)]:
        x = torch.randint(1, 100, (2, length))
        with tapped.intervene(_force_every_point(fns) if every_point else fns):
            out = tapped(x).logits
        torch.testing.assert_close(out, ref(x).logits)
        torch.testing.assert_close(tapped(x).logits, model(x).logits)


@torch.no_grad()
def test_an_edit_of_scores_beside_sdpa_not_selected_is_refused_not_ignored() -> None:
    """The scores beside SDPA are computed only where tap() selected them (as the pattern):
    an edit of them otherwise changed nothing, silently (the pattern selected or not)."""
    model = _gpt2()
    tapped = fxprobe.tap(model, ops=["blocks.*.resid_post", "blocks.1.attn.pattern"],
                         tracer="dynamo")
    x = torch.randint(1, 100, (1, 4))
    tapped(x)
    with pytest.raises(fxprobe.InterventionError, match="scores"):
        with tapped.intervene({"blocks.0.attn.scores": _zero}):
            tapped(x)
    torch.testing.assert_close(tapped(x).logits, model(x).logits)


def test_which_version_serves_a_table_is_read_once_not_across_another_threads_write() -> None:
    """``Instrumented.serves`` compared the remembered (table serial, sizes) and then read the
    answer from the attribute again: another thread's write in between (its own table's
    answer) gave this table that answer, so a block on an unselected site could run the graph
    without a point there, its edit dropped."""
    from fxprobe.frontends.dynamo_versions import Instrumented

    model = _gpt2()
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    x = torch.randint(1, 100, (1, 4))
    with torch.no_grad(), tapped.intervene({"transformer.h.1.mlp": _fn(_half)}):
        tapped(x)
        versions = [v for c in tapped._lifecycle().program.dynamo[""].captured
                    for v in c.versions.values()]
        (version,) = [v for v in versions if "transformer.h.1.mlp" in v.sites]
        assert isinstance(version, Instrumented)
        table = tapped._state.pipeline.per_call.table
        assert table is not None and not version.serves(table)

        class Written(tuple):  # type: ignore[type-arg]
            """The remembered answer, overwritten by another thread as it is compared."""

            def __getitem__(self, i: Any) -> Any:
                if isinstance(i, slice):
                    version.served = (-1, 0, 0, True)  # another table's: served
                return super().__getitem__(i)

        version.served = Written(version.served)
        assert not version.serves(table)
