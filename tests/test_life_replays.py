"""Sequences tests/test_life.py's long mode found, shrunk, against hooks on an untapped copy.

- GPT-2 under dynamo: a generation step's graph, which the canonical pass does not recognise,
  named ``lm_head`` again without its canonical name, and the region forgot that ``logits``
  is ``lm_head``: a later per-call block on ``logits`` said it matched no site.
- A deferred module past dynamo's recompile limit (``tracer="auto"``) runs as written from
  then on, said once (a warning, and ``DynamoError`` in a per-call run): the sites only dynamo
  reached are gone, and every later call says so instead of leaving them out silently.
- A block entered in eval mode, then ``train()`` and a ``run_with_cache`` in train mode inside
  it (which built train mode's graphs with points): later train-mode forwards in the block ran,
  where dynamo had stopped capturing the module in train mode, without the block's edit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from life_models import SPECS
from life_reference import edit_fn, run

import fxprobe


@pytest.fixture(autouse=True)
def _fresh() -> None:
    torch._dynamo.reset()  # dynamo caches per code object: each test starts afresh


def _ids(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 100, shape, generator=torch.Generator().manual_seed(seed))


def test_logits_after_generate_per_call() -> None:
    """forward, generate(), then a block on ``logits`` and a cache of it (r0, shrunk)."""
    spec = SPECS["gpt2"]
    model = spec.build()
    reference = spec.build()
    tapped = fxprobe.tap(model, ops=spec.ops, tracer=spec.tracer)
    try:
        ids = _ids((1, 5))
        tapped(input_ids=ids, use_cache=False)
        prompt = _ids((1, 4), 4)
        kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=1, do_sample=False)
        tokens = tapped.generate(prompt, **kw)
        assert torch.equal(tokens, reference.generate(prompt, **kw))
        point = spec.points["logits"]
        fn = edit_fn(-4.0, None)
        ids = _ids((2, 5), 1)
        with tapped.intervene({"logits": fn}):  # raised: 'logits' matches no site
            out = tapped(input_ids=ids, use_cache=False)
        ref, _ = run(reference, lambda: reference(input_ids=ids, use_cache=False),
                     [(point, fn)], {})
        assert torch.equal(out.logits, ref.logits)
        out, cache = tapped.run_with_cache(input_ids=ids, use_cache=False, names="logits")
        ref, seen = run(reference, lambda: reference(input_ids=ids, use_cache=False), [],
                        {"logits": point})
        assert torch.equal(cache["logits"], seen["logits"][0])
        assert torch.equal(out.logits, ref.logits)
    finally:
        tapped.remove()


def test_tap_selectors_after_the_recompile_limit_name_it() -> None:
    """Llama under "auto" (recompile limit 2): edits that raise at the first calls, in two
    dtypes, use up the limit before any forward ran to its end; the next forward runs as
    written, where tap()'s canonical selectors name no site. It says that dynamo's limit is
    why (r1, shrunk), not that the model has no ``blocks.1.resid_post``."""
    spec = SPECS["llama"]
    model = spec.build()

    def fails(site: object, value: torch.Tensor) -> torch.Tensor:
        raise ValueError("the edit failed")

    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tapped = fxprobe.tap(model, ops=spec.ops, tracer=spec.tracer)
        try:
            for dtype, shape in [(torch.float32, (1, 5)), (torch.float64, (1, 3))]:
                tapped.to(dtype)
                with pytest.raises(ValueError, match="the edit failed"):
                    with tapped.intervene({"blocks.0.resid_post": fails}):
                        tapped(input_ids=_ids(shape), use_cache=False)
            with pytest.raises(fxprobe.DynamoError, match="recompile_limit") as info:
                tapped(input_ids=_ids((2, 7)), use_cache=False)
            assert "blocks.1.resid_post" in str(info.value)
            assert isinstance(info.value.__cause__, fxprobe.SelectorError)
        finally:
            tapped.remove()


def test_a_module_past_the_recompile_limit_runs_as_written_and_says_so() -> None:
    """A second tap of the Twice model (tracer "auto") meets the recompile limit that the
    first tap used up (r2-r4, shrunk): Inner runs as written, said once by a warning. Every
    site (names=None) is then its module calls, equal to hooks; a block on a site only dynamo
    captured (inner.relu_1) raises DynamoError naming the limit, not 'matches no site'."""
    spec = SPECS["twice-auto"]
    model = spec.build()
    reference = spec.build()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(recompile_limit=1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first = fxprobe.tap(model, ops=spec.ops, tracer=spec.tracer)
            first(x)
            first.remove()
        tapped = fxprobe.tap(model, ops=spec.ops, tracer=spec.tracer)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                tapped(x)
            said = [str(w.message) for w in caught if "recompile_limit" in str(w.message)]
            assert len(said) == 1, [str(w.message) for w in caught]
            assert {f.path for f in tapped.fallbacks} == {"inner"}
            out, cache = tapped.run_with_cache(x)
            calls = ["inner.fc", "inner.fc_1", "inner.fc_2", "inner.fc_3"]
            ref, seen = run(reference, lambda: reference(x), [],
                            {n: spec.points[n] for n in [*calls, "head"]})
            assert torch.equal(out, ref)
            assert "inner.relu" not in cache and "inner.relu_1" not in cache
            for name in [*calls, "head"]:
                assert torch.equal(cache[name], seen[name][0]), name
            ran = []
            with pytest.raises(fxprobe.DynamoError, match="recompile_limit") as info:
                with tapped.intervene({"inner.relu_1": edit_fn(2.0, None)}):
                    ran.append(tapped(x))
            assert not ran  # the forward itself is refused, never run without the edit
            assert "'inner.relu_1'" in str(info.value)
        finally:
            tapped.remove()


@pytest.mark.parametrize("edited", ["transformer.h.0", "blocks.0.resid_post"])
def test_a_cache_under_an_edit_of_a_block_reads_what_the_next_block_gets(edited: str) -> None:
    """A per-call edit of block 0's output by its module's name, then ``run_with_cache`` of
    ``blocks.1.*`` (long mode, shrunk): ``blocks.1.resid_pre`` is the same value as the
    module's output, one node with both names, and read the value before the module's edit,
    which block 1 never got. Every name of a node now reads what flows on."""
    spec = SPECS["gpt2"]
    model, reference = spec.build(), spec.build()
    tapped = fxprobe.tap(model, ops=spec.ops, tracer=spec.tracer)
    try:
        ids = _ids((1, 3))
        fn = edit_fn(2.0, 0)
        names = ("blocks.1.resid_pre", "blocks.0.resid_post", "transformer.h.0")
        points = {n: spec.points[n] for n in names}
        ref, seen = run(reference, lambda: reference(input_ids=ids, use_cache=False),
                        [(spec.points[edited], fn)], points)
        for selector in ("blocks.1.*", list(names)):
            with tapped.intervene({edited: fn}):
                out, cache = tapped.run_with_cache(input_ids=ids, use_cache=False,
                                                   names=selector)
            assert torch.equal(out.logits, ref.logits)
            for n in (names[:1] if selector == "blocks.1.*" else names):
                assert torch.equal(cache[n], seen[n][0]), (selector, n)
    finally:
        tapped.remove()


def test_a_block_open_when_dynamo_stops_never_runs_its_forwards_unedited() -> None:
    """A block edits an op inside a module (``inner.relu_1``); dynamo stops capturing the
    module past its recompile limit inside the block (that forward raises, as documented).
    The next forward in the same block ran the module as written without the edit, silently
    (long mode, shrunk): it raises too. Edits of the module's calls (hook sites) still work."""
    spec = SPECS["twice-auto"]
    model, reference = spec.build(), spec.build()
    x = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in
         enumerate([(2, 3, 4), (2, 2, 2, 4), (4,)])]
    fn = edit_fn(-4.0, None)
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tapped = fxprobe.tap(model, ops=spec.ops, tracer=spec.tracer)
        try:
            tapped.run_with_cache(x[0], names="inner.*")
            with tapped.intervene({"inner.relu_1": fn}):
                with pytest.raises(fxprobe.DynamoError, match="recompile_limit"):
                    tapped.run_with_cache(x[1])  # dynamo stops here
                with pytest.raises(fxprobe.DynamoError, match="inner.relu_1"):
                    tapped(x[2])  # ran unedited
            assert torch.equal(tapped(x[2]), reference(x[2]))  # outside: as written
            late = tapped.intervene({"inner.relu_*": fn})  # a block made since: the same
            with pytest.raises(fxprobe.DynamoError, match="'inner.relu_\\*' matches no site"):
                with late:  # leaving says the selector matched nothing, as before
                    with pytest.raises(fxprobe.DynamoError, match="this block edits 'inner.relu"):
                        tapped(x[2])  # ran unedited: only leaving the block said so
            hook = edit_fn(0.5, 1)
            with tapped.intervene({"inner.fc_3": hook}):  # a module call: a hook site
                out = tapped(x[2])
            ref, _ = run(reference, lambda: reference(x[2]), [(spec.points["inner.fc_3"], hook)],
                         {})
            assert torch.equal(out, ref)
        finally:
            tapped.remove()


def test_a_block_refuses_the_other_mode_after_a_cache_in_it() -> None:
    """Twice under "auto": a block on ``inner.relu_1`` entered in eval mode, ``train()``, then
    ``run_with_cache`` in train mode inside it (dynamo stops capturing Inner there, past its
    recompile limit: it raises as documented, or runs). The next train-mode forward in the
    block ran Inner as written without the edit, silently (long mode, shrunk): the cache had
    built train mode's graphs with points, which was all the mode check looked at. It
    refuses the forward, as it does without the cache; after the block, hooks' values."""
    spec = SPECS["twice-auto"]
    model, reference = spec.build(), spec.build()
    x = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in
         enumerate([(3, 4), (2, 2, 2, 4), (4,), (2, 3, 4)])]
    fn = edit_fn(-4.0, None)
    with torch._dynamo.config.patch(recompile_limit=8), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tapped = fxprobe.tap(model, ops=spec.ops, tracer=spec.tracer)
        try:
            tapped(x[0])
            tapped(x[1])
            with tapped.intervene({"inner.relu_1": fn}):
                out = tapped(x[2])
                ref, _ = run(reference, lambda: reference(x[2]),
                             [(spec.points["inner.relu_1"], fn)], {})
                assert torch.equal(out, ref)
                tapped(x[3])
                tapped.train()
                reference.train()
                try:
                    tapped.run_with_cache(x[1], names=["inner.relu_1", "inner.fc"])
                except fxprobe.DynamoError as e:
                    assert "recompile_limit" in str(e)
                with pytest.raises(fxprobe.ConfigError, match="entered in the other mode"):
                    tapped(x[2])  # ran Inner as written, unedited
            out = tapped(x[2])
            ref, seen = run(reference, lambda: reference(x[2]), [],
                            {"inner.fc_3": spec.points["inner.fc_3"]})
            assert torch.equal(out, ref)
            assert torch.equal(tapped.taps["inner.fc_3"], seen["inner.fc_3"][0])
        finally:
            tapped.remove()
