"""Captures.dataset: rows of captured values as a torch Dataset, checked against the values
forward hooks cloned while the same forwards ran, laid out by hand."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import fxprobe


class Block(nn.Module):
    """[batch, pos, d] -> [batch, pos, d]: what a transformer's residual stream looks like."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x)) * mask[..., None]


def batches(n: int, b: int = 3, t: int = 4, d: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs whose row 0 of each position is a global row id, and left-padded masks."""
    out = []
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        x = torch.randn(b, t, d, generator=g)
        x[..., 0] = torch.arange(i * b * t, (i + 1) * b * t, dtype=torch.float).view(b, t)
        mask = torch.ones(b, t)
        mask[1, :2] = 0  # a left-padded row
        mask[2, :1] = 0
        out.append((x, mask))
    return out


def harvest(model: nn.Module, path: Path, data: list[tuple[torch.Tensor, torch.Tensor]],
            **disk: object) -> dict[str, list[torch.Tensor]]:
    """Write ``data``'s forwards to ``path``; return what cloning hooks saw (the reference)."""
    seen: dict[str, list[torch.Tensor]] = {"lin": [], "act": [], "mask": []}
    handles = [model.lin.register_forward_hook(lambda m, i, o: seen["lin"].append(o.clone())),
               model.act.register_forward_hook(lambda m, i, o: seen["act"].append(o.clone())),
               model.register_forward_pre_hook(
                   lambda m, args: seen["mask"].append(args[1].clone()))]
    try:
        with torch.no_grad(), fxprobe.tap(model, ops=["lin", "act", "mask"],
                                          to=fxprobe.Disk(path, **disk)) as tapped:  # type: ignore[arg-type]
            for x, mask in data:
                tapped(x, mask)
    finally:
        for h in handles:
            h.remove()
    return seen


def rows_of(loader: DataLoader) -> torch.Tensor:
    return torch.cat([b if isinstance(b, torch.Tensor) else b["lin"] for b in loader])


def test_token_rows_are_every_position_in_order(tmp_path: Path) -> None:
    model = Block()
    seen = harvest(model, tmp_path, batches(5), shard_size=2_000)
    ds = fxprobe.open_captures(tmp_path).dataset("lin", rows="tokens")
    expected = torch.cat([v.reshape(-1, 6) for v in seen["lin"]])
    assert len(ds) == expected.shape[0] == 5 * 3 * 4
    assert torch.equal(torch.stack([ds[i] for i in range(len(ds))]), expected)
    assert torch.equal(ds[-1], expected[-1])
    assert ds.row_shapes == {"lin": (6,)}
    with pytest.raises(IndexError, match="60 rows"):
        ds[60]


def test_sample_rows_and_several_names_give_dicts(tmp_path: Path) -> None:
    model = Block()
    seen = harvest(model, tmp_path, batches(3))
    ds = fxprobe.open_captures(tmp_path).dataset(["lin", "act"], rows="samples")
    assert len(ds) == 3 * 3
    for name in ("lin", "act"):
        expected = torch.cat(seen[name])  # one row per batch element: [pos, d]
        got = torch.stack([ds[i][name] for i in range(len(ds))])
        assert torch.equal(got, expected), name


def test_masked_positions_are_left_out(tmp_path: Path) -> None:
    model = Block()
    seen = harvest(model, tmp_path, batches(4))
    ds = fxprobe.open_captures(tmp_path).dataset("lin", mask="mask")
    keep = torch.cat([m.reshape(-1) for m in seen["mask"]]).bool()
    expected = torch.cat([v.reshape(-1, 6) for v in seen["lin"]])[keep]
    assert len(ds) == int(keep.sum()) == 4 * (12 - 3)
    assert torch.equal(torch.stack([ds[i] for i in range(len(ds))]), expected)
    # the batched read DataLoader uses gives the same rows
    assert torch.equal(torch.stack(ds.__getitems__(list(range(len(ds))))), expected)
    with pytest.raises(fxprobe.ConfigError, match="rows='tokens'"):
        fxprobe.open_captures(tmp_path).dataset("lin", rows="samples", mask="mask")


@pytest.mark.parametrize("workers", [0, 2])
def test_shuffled_loader_reads_every_row_once(tmp_path: Path, workers: int) -> None:
    model = Block()
    seen = harvest(model, tmp_path, batches(6), shard_size=3_000)
    ds = fxprobe.open_captures(tmp_path).dataset("lin")
    ds[0]  # maps opened here must not travel to the workers
    pickle.loads(pickle.dumps(ds))
    torch.manual_seed(0)
    loader = DataLoader(ds, batch_size=7, shuffle=True, num_workers=workers)
    got = rows_of(loader)
    expected = torch.cat([v.reshape(-1, 6) for v in seen["lin"]])
    assert got.shape == expected.shape
    assert not torch.equal(got, expected)  # shuffled
    # column 0 of the input is the row id; lin mixes it, so match rows by sorting on the id
    # recovered from an exact lookup of each row in the reference
    order = [int((expected == row).all(1).nonzero().item()) for row in got]
    assert sorted(order) == list(range(expected.shape[0]))


def test_unknown_names_and_wrong_shapes_are_refused(tmp_path: Path) -> None:
    model = Block()
    harvest(model, tmp_path, batches(2))
    caps = fxprobe.open_captures(tmp_path)
    with pytest.raises(fxprobe.UnknownSiteError, match="'lin'"):
        caps.dataset("lni")
    with pytest.raises(fxprobe.ConfigError, match="rows='words'"):
        caps.dataset("lin", rows="words")  # type: ignore[arg-type]
    with pytest.raises(fxprobe.ConfigError, match="site name or a list"):
        caps.dataset([])


def test_ranks_read_as_one_dataset(tmp_path: Path) -> None:
    per_rank = {}
    for rank in (0, 1):
        torch.manual_seed(rank)
        model = Block()
        per_rank[rank] = harvest(model, tmp_path, batches(2 + rank), rank=rank)
    caps = fxprobe.open_captures(tmp_path)
    assert len(caps) == 2 + 3
    assert [caps.rank_of(i) for i in range(len(caps))] == [0, 0, 1, 1, 1]
    ds = caps.dataset("lin")
    expected = torch.cat([v.reshape(-1, 6) for r in (0, 1) for v in per_rank[r]["lin"]])
    assert torch.equal(torch.stack([ds[i] for i in range(len(ds))]), expected)
    one = fxprobe.open_captures(tmp_path, rank=1)
    assert len(one) == 3 and one.rank_of(0) == 1


def test_a_dataset_sees_committed_shards_only(tmp_path: Path) -> None:
    model = Block()
    data = batches(4)
    disk = fxprobe.Disk(tmp_path, shard_size=1)  # every forward commits its own shard
    with torch.no_grad(), fxprobe.tap(model, ops="lin", to=disk) as tapped:
        for x, mask in data[:2]:
            tapped(x, mask)
        disk.flush()
        (tmp_path / "shard-000099.safetensors.partial").write_bytes(b"\0" * 64)  # in flight
        early = fxprobe.open_captures(tmp_path).dataset("lin")
        for x, mask in data[2:]:
            tapped(x, mask)
    assert len(early) == 2 * 12
    assert len(fxprobe.open_captures(tmp_path).dataset("lin")) == 4 * 12


def test_batches_of_rows_read_as_one_gather(tmp_path: Path) -> None:
    from torch.utils.data import BatchSampler, RandomSampler

    model = Block()
    seen = harvest(model, tmp_path, batches(4), shard_size=2_000)
    ds = fxprobe.open_captures(tmp_path).dataset(["lin", "act"], mask="mask")
    keep = torch.cat([m.reshape(-1) for m in seen["mask"]]).bool()
    expected = {n: torch.cat([v.reshape(-1, 6) for v in seen[n]])[keep] for n in ("lin", "act")}
    rows = [5, 0, 35, 5, -1]
    got = ds[rows]
    for n in ("lin", "act"):
        assert torch.equal(got[n], expected[n][rows]), n
    torch.manual_seed(0)
    loader = DataLoader(ds, batch_size=None,
                        sampler=BatchSampler(RandomSampler(ds), 10, drop_last=False))
    got_all = torch.cat([b["act"] for b in loader])
    order = [int((expected["act"] == row).all(1).nonzero().item()) for row in got_all]
    assert sorted(order) == list(range(len(ds)))
    with pytest.raises(IndexError, match="out of range"):
        ds[[0, len(ds)]]


def test_the_sae_walkthrough_in_the_docs_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import re
    import tempfile

    text = (Path(__file__).resolve().parent.parent / "docs/disk.md").read_text()
    section = text.split("## Harvest activations for a sparse autoencoder")[1]
    code = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    exec(compile(code, "docs/disk.md (SAE walkthrough)", "exec"), {"__name__": "__docs__"})
    assert capsys.readouterr().out.split() == ["16", "1024", "0", "1", "True"]


class Pass(nn.Module):
    """Records ``h`` and the masks it is given (as inputs), and ``h * 1``."""

    def forward(self, h: torch.Tensor, mask: torch.Tensor, transposed: torch.Tensor
                ) -> torch.Tensor:
        return h * 1


def masked_harvest(path: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    data = []
    with fxprobe.tap(Pass(), to=fxprobe.Disk(path)) as tapped:
        for f in range(2):
            h = torch.arange(4 * 6 * 2, dtype=torch.float32).reshape(4, 6, 2) + 1000 * f
            mask = torch.rand(4, 6, generator=g) > 0.5
            tapped(h, mask, mask.T.contiguous())  # [pos, batch]: as many elements, not rows
            data.append((h, mask))
    return data


def test_a_mask_must_have_the_values_batch_and_positions(tmp_path: Path) -> None:
    data = masked_harvest(tmp_path)
    caps = fxprobe.open_captures(tmp_path)
    ds = caps.dataset("mul", mask="mask")
    by_hand = torch.cat([h.flatten(0, 1)[m.reshape(-1)] for h, m in data])
    assert torch.equal(ds[list(range(len(ds)))], by_hand)
    with pytest.raises(fxprobe.DiskError, match=r"'transposed'.*\(6, 4\).*\[4, 6\]"):
        caps.dataset("mul", mask="transposed")


def test_rows_are_read_by_integers_only(tmp_path: Path) -> None:
    data = masked_harvest(tmp_path)
    ds = fxprobe.open_captures(tmp_path).dataset("mul", rows="samples")
    by_hand = torch.cat([h for h, _ in data])
    assert torch.equal(ds[np.int64(1)], by_hand[1])
    assert torch.equal(ds[np.array([3, -1])], by_hand[[3, -1]])
    assert torch.equal(ds[torch.tensor([5, 0], dtype=torch.int32)], by_hand[[5, 0]])
    mask = torch.tensor([True, False, False, True, False, False, False, False])
    for bad, why in ((mask, "torch.bool"), (mask.tolist(), "torch.bool"),
                     (torch.tensor([0.9, 2.7]), "torch.float32"), ([0.9, 2.7], "float"),
                     ([[0, 1], [2, 3]], r"shape \(2, 2\)"), (1.0, "float")):
        with pytest.raises(TypeError, match=why):
            ds[bad]
    assert torch.equal(ds[mask.nonzero().flatten()], by_hand[mask])


def test_no_rows_keep_the_sites_dtype(tmp_path: Path) -> None:
    masked_harvest(tmp_path)
    caps = fxprobe.open_captures(tmp_path)
    for name, dtype in (("mask", torch.bool), ("mul", torch.float32)):
        ds = caps.dataset(name, rows="samples")
        assert ds[[]].dtype == dtype == ds[[0]].dtype
        assert ds[[]].shape == (0, *caps.forward(0)[name].shape[1:])


def test_a_site_whose_dtype_changes_is_refused_when_the_dataset_is_made(tmp_path: Path) -> None:
    class Double(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h * 2

    with fxprobe.tap(Double(), to=fxprobe.Disk(tmp_path)) as tapped:
        tapped(torch.ones(2, 3, 4))
        tapped(torch.ones(2, 3, 4, dtype=torch.bfloat16))
    with pytest.raises(fxprobe.DiskError, match="'mul'.*bfloat16.*forward 1.*float32 before"):
        fxprobe.open_captures(tmp_path).dataset("mul")


def test_a_dataset_reads_a_shards_data_only_with_its_rows(tmp_path: Path) -> None:
    masked_harvest(tmp_path)
    shard = tmp_path / "shard-000000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    ds = fxprobe.open_captures(tmp_path).dataset("mul")  # shapes only: no error yet
    with pytest.raises(fxprobe.DiskError, match="shard-000000.*checksum"):
        ds[list(range(len(ds)))]  # the rows whose block holds the changed byte
