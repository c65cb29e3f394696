"""Review of the SAE reader and stream: sequences of calls checked against references.

Each test here failed before the fix it names (states taken at an epoch's edge, ...).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sae_models import batches, reference_rows, tiny

import fxprobe


def _stream(tapped: object, inputs: list, **options: object) -> fxprobe.ActivationStream:
    return fxprobe.ActivationStream(tapped, "emb", inputs, batch_size=3, buffer=1, seed=0,
                                    mask="attention_mask", **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("options", [{}, {"refill": 0.0}, {"drop_last": True}])
def test_a_state_after_an_epochs_last_batch_does_not_run_that_epoch_again(options: dict) -> None:
    # Before the fix the resumed stream ran the finished epoch again: every row twice.
    # Now, as the original iterator would, it ends that epoch (no batch), then the next.
    inputs = batches(4)
    tapped = fxprobe.tap(tiny(), ops=["emb", "attention_mask"])
    stream = _stream(tapped, inputs, **options)
    it = iter(stream)
    n = len(list(_stream(tapped, inputs, **options)))
    first = [next(it) for _ in range(n)]          # the whole epoch, the generator not ended
    state = stream.state_dict()
    assert list(it) == []                         # the original: nothing more in epoch 0
    following = list(stream)                      # ... then epoch 1
    resumed = _stream(tapped, inputs, **options)
    resumed.load_state_dict(state)
    assert list(resumed) == []
    again = list(resumed)
    assert len(again) == len(following)
    assert all(torch.equal(a, b) for a, b in zip(again, following, strict=True))
    rows = torch.cat(first)
    expected = reference_rows(inputs, mask=True)
    assert len(rows) == len(expected) - (len(expected) % 3 if options.get("drop_last") else 0)
    assert set(map(tuple, rows.tolist())) <= set(map(tuple, expected.tolist()))


def test_rows_of_several_canonical_sites_are_keyed_as_asked_like_the_streams(
        tmp_path: Path) -> None:
    # Before the fix the dataset keyed them by the model's names (transformer.h.0.add_1):
    # batch["blocks.0.resid_post"] was a KeyError where the stream's batch had it.
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    seen: list[torch.Tensor] = []
    hooked = transformers.GPT2LMHeadModel(config).eval()
    hooked.load_state_dict(model.state_dict())
    hooked.transformer.h[1].register_forward_hook(
        lambda m, a, o: seen.append((o[0] if isinstance(o, tuple) else o).detach().clone()))
    with torch.no_grad():
        hooked(input_ids=ids)
    sites = ["blocks.0.resid_post", "blocks.1.resid_post"]
    with fxprobe.tap(model, ops=sites, to=fxprobe.Disk(tmp_path / "a")) as tapped:
        streamed = next(iter(fxprobe.ActivationStream(tapped, sites, [{"input_ids": ids}],
                                                      batch_size=10, seed=0)))
    ds = fxprobe.open_captures(tmp_path / "a").dataset(sites, normalize=True)
    rows = ds[list(range(len(ds)))]
    assert list(rows) == list(streamed) == sites
    torch.testing.assert_close(ds.denormalize(rows)["blocks.1.resid_post"],
                               seen[0].flatten(0, 1))
    assert list(ds.__getitems__([0, 1])[0]) == sites


def test_normalize_leaves_token_ids_read_beside_the_rows_as_they_are(tmp_path: Path) -> None:
    # Before the fix normalize=True with a site of token ids (rows of shape ()) beside the
    # activations was an IndexError, in the dataset and in the stream.
    inputs = batches(3)
    ops = ["emb", "attention_mask", "input_ids"]
    with fxprobe.tap(tiny(), ops=ops, to=fxprobe.Disk(tmp_path / "a")) as tapped:
        stream = fxprobe.ActivationStream(tapped, ["emb", "input_ids"], inputs, batch_size=500,
                                          mask="attention_mask", normalize=True)
        streamed = next(iter(stream))
    ds = fxprobe.open_captures(tmp_path / "a").dataset(["emb", "input_ids"],
                                                       mask="attention_mask", normalize=True)
    rows = ds[list(range(len(ds)))]
    ids = torch.cat([kw["input_ids"][kw["attention_mask"].bool()] for kw in inputs])
    assert torch.equal(rows["input_ids"], ids)
    assert torch.equal(ds.denormalize(rows)["input_ids"], ids)
    torch.testing.assert_close(ds.denormalize(rows)["emb"], reference_rows(inputs, mask=True))
    assert set(ds.scale.factors) == set(stream.scale.factors) == {"emb"}
    assert rows["emb"].norm(dim=1).mean().item() ** 2 == pytest.approx(rows["emb"].shape[1])
    assert sorted(streamed["input_ids"].tolist()) == sorted(ids.tolist())


def test_a_second_epoch_over_an_iterator_of_inputs_says_so_instead_of_no_rows() -> None:
    # Before the fix the second epoch over a generator silently gave no batch at all.
    inputs = batches(3)
    tapped = fxprobe.tap(tiny(), ops=["emb", "attention_mask"])
    stream = _stream(tapped, iter(inputs))
    rows = torch.cat(list(stream))
    assert sorted(map(tuple, rows.tolist())) == \
        sorted(map(tuple, reference_rows(inputs, mask=True).tolist()))
    with pytest.raises(fxprobe.ConfigError, match="iterator that an earlier epoch ran"):
        list(stream)
    stream.inputs = iter(inputs)                  # a new pass: the next epoch, every row
    assert len(torch.cat(list(stream))) == len(rows)
    resumed = _stream(tapped, (b for b in inputs))
    it = iter(stream := _stream(tapped, inputs))
    next(it)
    resumed.load_state_dict(stream.state_dict())  # a fresh generator resumes as a list does
    assert all(torch.equal(a, b) for a, b in zip(resumed, it, strict=True))


def test_denormalize_of_stacked_integer_sites_gives_them_back(tmp_path: Path) -> None:
    # Before the fix: a KeyError (integer sites have no factor since normalize skips them).
    inputs = batches(2)
    with fxprobe.tap(tiny(), ops=["attention_mask", "input_ids"],
                     to=fxprobe.Disk(tmp_path / "a")) as tapped:
        for kw in inputs:
            tapped(**kw)
    ds = fxprobe.open_captures(tmp_path / "a").dataset(["input_ids", "attention_mask"],
                                                       layout="stack", normalize=True)
    rows = ds[list(range(len(ds)))]
    expected = torch.cat([torch.stack([kw["input_ids"], kw["attention_mask"]], -1).flatten(0, 1)
                          for kw in inputs])
    assert torch.equal(rows, expected)
    assert torch.equal(ds.denormalize(rows), expected)


def test_arrow_columns_are_named_as_the_rows_are_keyed(tmp_path: Path) -> None:
    # Before the fix two canonical names of one site (blocks.0.resid_post is
    # blocks.1.resid_pre) made pyarrow refuse a schema naming transformer.h.0.add_1 twice.
    hf = pytest.importorskip("datasets")
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)
    torch.manual_seed(0)
    sites = ["blocks.0.resid_post", "blocks.1.resid_pre"]
    with fxprobe.tap(transformers.GPT2LMHeadModel(config).eval(), ops=sites,
                     to=fxprobe.Disk(tmp_path / "a")) as tapped:
        tapped(input_ids=torch.arange(12).reshape(2, 6))
    ds = fxprobe.open_captures(tmp_path / "a").dataset(sites)
    loaded = hf.Dataset.from_file(str(ds.to_arrow(tmp_path / "a.arrow"))).with_format("torch")
    assert loaded.column_names == sites
    rows = ds[list(range(len(ds)))]
    for s in sites:
        torch.testing.assert_close(loaded[s][:], rows[s])


class _Branch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        return self.a(x) if use_a else self.b(x)


def test_forwards_that_skip_the_site_give_no_rows_as_on_disk() -> None:
    # Before the fix a forward taking the other branch stopped the stream (SiteNotRunError
    # wrapped in "tap it with the rest"), where the Disk dataset leaves such forwards out.
    torch.manual_seed(0)
    model = _Branch().eval()
    xs = [(torch.randn(2, 4, 3), i % 2 == 0) for i in range(5)]
    tapped = fxprobe.tap(model, ops=["a", "b"], tracer="hooks")
    got = torch.cat(list(fxprobe.ActivationStream(tapped, "a", xs, batch_size=100)))
    with torch.no_grad():
        expected = torch.cat([model.a(x).flatten(0, 1) for x, use in xs if use])
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, expected.tolist()))
    with pytest.raises(fxprobe.DiskError, match=r"ran \['a'\] but not \['b'\]"):
        list(fxprobe.ActivationStream(tapped, ["a", "b"], xs, batch_size=100))
    with pytest.raises(fxprobe.ConfigError, match="none of the 2 forwards"):
        list(fxprobe.ActivationStream(tapped, "a", [x for x in xs if not x[1]]))


def test_endless_inputs_that_never_reach_the_site_are_an_error_not_a_hang() -> None:
    import itertools

    tapped = fxprobe.tap(_Branch().eval(), ops=["a", "b"], tracer="hooks")
    endless = itertools.repeat((torch.randn(1, 2, 3), False))
    with pytest.raises(fxprobe.ConfigError, match="none of the 256 forwards"):
        next(iter(fxprobe.ActivationStream(tapped, "a", endless)))
