"""What SAE trainers expect of the Disk reader: rows filtered by mask, token ids and positions,
normalized (invertibly, the factor in the state), several sites side by side, a stateful
sampler split across ranks, torchdata's StatefulDataLoader. References: forward hooks on an
untapped copy (tests/sae_models.py), rows selected by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from sae_models import D, batches, hooked, reference_rows, tiny
from torch.utils.data import DataLoader

import fxprobe
from fxprobe.sinks.sampler import RowSampler

OPS = ["input_ids", "attention_mask", "emb", "lin"]


def harvest(path: Path, n: int = 6) -> list[dict[str, torch.Tensor]]:
    inputs = batches(n)
    with torch.no_grad(), fxprobe.tap(tiny(), ops=OPS, to=fxprobe.Disk(path)) as tapped:
        for kw in inputs:
            tapped(**kw)
    return inputs


def all_rows(ds: object) -> torch.Tensor:
    return ds[list(range(len(ds)))]  # type: ignore[index,arg-type]


@pytest.mark.parametrize("options", [
    {"mask": True}, {"exclude": (1,)}, {"positions": slice(1, None)},
    {"mask": True, "exclude": (1, 7), "positions": slice(0, 5)}, {"positions": slice(-2, None)},
], ids=["mask", "bos", "positions", "all", "last-two"])
def test_rows_are_the_hooks_rows_that_are_kept(tmp_path: Path, options: dict) -> None:
    inputs = harvest(tmp_path)
    caps = fxprobe.open_captures(tmp_path)
    ds = caps.dataset("emb", mask="attention_mask" if options.get("mask") else None,
                      exclude_token_ids=options.get("exclude"),
                      positions=options.get("positions"))
    expected = reference_rows(inputs, mask=bool(options.get("mask")),
                              exclude=options.get("exclude", ()),
                              positions=options.get("positions"))
    assert len(ds) == len(expected) < sum(kw["input_ids"].numel() for kw in inputs)
    assert torch.equal(all_rows(ds), expected)
    assert torch.equal(ds[3], expected[3])  # one row, then a batch again: same answers
    assert torch.equal(torch.stack(ds.__getitems__([5, 0])), expected[[5, 0]])


def test_filters_say_what_is_missing_or_wrong(tmp_path: Path) -> None:
    inputs = batches(2)
    with torch.no_grad(), fxprobe.tap(tiny(), ops=["emb", "attention_mask"],
                                      to=fxprobe.Disk(tmp_path)) as tapped:
        for kw in inputs:
            tapped(**kw)
    caps = fxprobe.open_captures(tmp_path)
    with pytest.raises(fxprobe.DiskError, match="token ids 'input_ids'.*tap it"):
        caps.dataset("emb", exclude_token_ids=[1])
    with pytest.raises(fxprobe.ConfigError, match="exclude_token_ids=1"):
        caps.dataset("emb", exclude_token_ids=1)  # type: ignore[arg-type]
    with pytest.raises(fxprobe.ConfigError, match="positions="):
        caps.dataset("emb", positions=3)  # type: ignore[arg-type]
    with pytest.raises(fxprobe.ConfigError, match="rows='tokens'"):
        caps.dataset("emb", rows="samples", positions=slice(1, None))
    with pytest.raises(fxprobe.ConfigError, match="layout="):
        caps.dataset("emb", layout="tuple")  # type: ignore[arg-type]


def test_normalized_rows_have_mean_norm_sqrt_d_and_invert(tmp_path: Path) -> None:
    inputs = harvest(tmp_path)
    caps = fxprobe.open_captures(tmp_path)
    ds = caps.dataset("lin", mask="attention_mask", normalize=True)
    raw = reference_rows(inputs, "lin", mask=True)
    assert len(raw) < 8192  # the sample is every row: the factor is exact
    factor = math.sqrt(D) / float(raw.double().norm(dim=1).mean())
    assert ds.scale is not None and ds.scale.factors["lin"] == pytest.approx(factor, rel=1e-6)
    got = all_rows(ds)
    assert float(got.norm(dim=1).mean()) == pytest.approx(math.sqrt(D), rel=1e-5)
    torch.testing.assert_close(got, raw * factor)
    torch.testing.assert_close(ds.denormalize(got), raw)
    torch.testing.assert_close(ds.denormalize(ds[4]), raw[4])
    # The factor travels in the state: another dataset of the same rows reads them alike.
    plain = caps.dataset("lin", mask="attention_mask")
    assert torch.equal(all_rows(plain), raw)
    plain.load_state_dict(ds.state_dict())
    torch.testing.assert_close(all_rows(plain), got)
    with pytest.raises(fxprobe.ConfigError, match="resumes only the same rows"):
        caps.dataset("lin").load_state_dict(ds.state_dict())
    # A given factor is used as given; several sites take one each.
    assert torch.equal(all_rows(caps.dataset("lin", mask="attention_mask", normalize=2.0)),
                       raw * 2.0)
    with pytest.raises(fxprobe.ConfigError, match="a factor each"):
        caps.dataset(["emb", "lin"], normalize=2.0)


def test_several_sites_stack_into_batch_sites_d(tmp_path: Path) -> None:
    inputs = harvest(tmp_path)
    caps = fxprobe.open_captures(tmp_path)
    ds = caps.dataset(["emb", "lin"], mask="attention_mask", layout="stack", normalize=True)
    emb, lin = (reference_rows(inputs, s, mask=True) for s in ("emb", "lin"))
    got = all_rows(ds)
    assert got.shape == (len(emb), 2, D) and ds[0].shape == (2, D)
    torch.testing.assert_close(ds.denormalize(got), torch.stack([emb, lin], dim=1))
    torch.testing.assert_close(ds.denormalize(ds[7]), torch.stack([emb[7], lin[7]]))
    by_name = caps.dataset(["emb", "lin"], mask="attention_mask")[[2, 9]]
    assert torch.equal(by_name["emb"], emb[[2, 9]]) and torch.equal(by_name["lin"],
                                                                    lin[[2, 9]])


def test_the_sampler_splits_an_epoch_across_ranks_and_resumes(tmp_path: Path) -> None:
    harvest(tmp_path)
    ds = fxprobe.open_captures(tmp_path).dataset("emb", mask="attention_mask")
    n = len(ds)
    parts = [[i for b in RowSampler(ds, 5, seed=3, rank=r, world_size=3) for i in b]
             for r in range(3)]
    assert {i for p in parts for i in p} == set(range(n))  # covering, padded to 3 equal parts
    assert [len(p) for p in parts] == [-(-n // 3)] * 3
    s = RowSampler(ds, 5, seed=3)
    first, second = list(s), list(s)  # the epoch advances by itself
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, []))
    assert list(RowSampler(ds, 5, seed=3)) == first  # deterministic under a seed
    s = RowSampler(ds, 5, seed=3)
    s.set_epoch(1)
    assert list(s) == second
    # Resume mid-epoch from a state: the batches not yet given, then the next epoch.
    s = RowSampler(ds, 5, seed=3)
    loader = DataLoader(ds, batch_size=None, sampler=s)
    it = iter(loader)
    seen = [next(it) for _ in range(3)]
    state = s.state_dict()
    resumed = RowSampler(ds, 5, seed=3)
    resumed.load_state_dict(state)
    rest = list(DataLoader(ds, batch_size=None, sampler=resumed))
    whole = torch.cat([ds[b] for b in first])
    assert torch.equal(torch.cat([*seen, *rest]), whole)
    assert list(resumed)[0] == second[0]
    with pytest.raises(fxprobe.ConfigError, match="batch_size"):
        RowSampler(ds, 6, seed=3).load_state_dict(state)
    with pytest.raises(fxprobe.ConfigError, match="rank"):
        RowSampler(ds, 5, rank=3, world_size=3)
    with pytest.raises(fxprobe.ConfigError, match="pass both"):
        RowSampler(ds, 5, world_size=2)  # every rank would take rank 0's rows


@pytest.mark.parametrize("workers", [0, 2])
def test_torchdata_stateful_dataloader_resumes_mid_epoch(tmp_path: Path, workers: int) -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    harvest(tmp_path)
    ds = fxprobe.open_captures(tmp_path).dataset("emb", normalize=True)

    def loader() -> object:
        return sdl.StatefulDataLoader(ds, batch_size=None, num_workers=workers,
                                      sampler=RowSampler(ds, 4, seed=1))

    whole = list(loader())  # type: ignore[call-overload]
    first = loader()
    it = iter(first)  # type: ignore[call-overload]
    head = [next(it) for _ in range(5)]
    state = first.state_dict()  # type: ignore[attr-defined]
    again = loader()
    again.load_state_dict(state)  # type: ignore[attr-defined]
    tail = list(again)  # type: ignore[call-overload]
    assert len(head) + len(tail) == len(whole)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, whole, strict=True))


def test_hooks_reference_is_the_tapped_models_own(tmp_path: Path) -> None:
    """The reference itself: what Disk holds per forward is what the hooks saw."""
    inputs = harvest(tmp_path, 2)
    caps = fxprobe.open_captures(tmp_path)
    for f, h in enumerate(hooked(inputs)):
        assert torch.equal(caps.forward(f)["emb"], h)


def test_arrow_export_reads_back_with_hugging_face_datasets(tmp_path: Path) -> None:
    hf = pytest.importorskip("datasets")
    inputs = harvest(tmp_path / "acts")
    caps = fxprobe.open_captures(tmp_path / "acts")
    ds = caps.dataset(["emb", "lin"], mask="attention_mask", normalize=True)
    path = ds.to_arrow(tmp_path / "acts.arrow", batch_size=7)  # several record batches
    loaded = hf.Dataset.from_file(str(path)).with_format("torch")
    emb, lin = (reference_rows(inputs, s, mask=True) for s in ("emb", "lin"))
    assert len(loaded) == len(emb) and loaded.column_names == ["emb", "lin"]
    assert ds.scale is not None
    torch.testing.assert_close(loaded["emb"][:], emb * ds.scale.factors["emb"])
    torch.testing.assert_close(loaded["lin"][:], lin * ds.scale.factors["lin"])
    import json

    import pyarrow as pa

    with pa.OSFile(str(path)) as f:  # the factors travel with the rows
        record = json.loads(pa.ipc.open_stream(f).schema.metadata[b"fxprobe"])
    assert record["scale"] == ds.scale.factors and record["rows"] == len(emb)
