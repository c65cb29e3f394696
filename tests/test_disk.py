"""fxprobe.Disk and open_captures, checked against keep="all" in memory and safetensors' reader."""


from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
from disk_support import ROOT, check_same, inputs, run_both
from reference import hook_values, same
from safetensors.torch import load_file
from torch import nn

import fxprobe
from fxprobe.sinks import shards as _shards


def test_every_forward_reads_back_as_keep_all_held_it(tmp_path: Path) -> None:
    model, (x,), _ = zoo.make("resnet")  # in-place ReLUs and += overwrite values
    xs = inputs(5, tuple(x.shape))
    expected, caps = run_both(model, tmp_path, xs, disk={"shard_size": 20_000})
    check_same(expected, caps)
    assert len(caps._shards) > 1  # noqa: SLF001 (several shards, each of whole forwards)
    assert caps.names == tuple(expected[0])
    for name in caps.names:
        assert torch.equal(caps[name], torch.cat([f[name] for f in expected]))


def test_shards_are_standard_safetensors(tmp_path: Path) -> None:
    model, (x,), _ = zoo.make("resnet")
    xs = inputs(3, tuple(x.shape))
    expected, caps = run_both(model, tmp_path, xs, disk={"shard_size": 20_000})
    index = json.loads((tmp_path / "index.json").read_text())
    seen = {}
    for shard in index["shards"]:
        for key, t in load_file(tmp_path / shard["file"]).items():
            if not key.startswith("__pad__"):
                seen[key] = t
    for i, frame in enumerate(expected):
        for name, value in frame.items():
            assert torch.equal(seen[f"{i}/{name}/0"], value)


def test_structures_stats_and_samples(tmp_path: Path) -> None:
    model, args, kwargs = zoo.make("multi_io")
    ref = fxprobe.tap(model, capture="both", keep="all")
    disk = fxprobe.Disk(tmp_path / "both")
    with torch.no_grad(), fxprobe.tap(model, capture="both", to=disk) as tapped:
        for _ in range(2):
            ref(*args, **kwargs)
            tapped(*args, **kwargs)
    check_same([dict(f.items()) for f in ref.history], fxprobe.open_captures(tmp_path / "both"))

    model, (x,), _ = zoo.make("resnet")
    xs = inputs(3, tuple(x.shape))
    for reduce in ("stats", "sample"):
        expected, caps = run_both(model, tmp_path / reduce, xs, reduce=reduce)
        check_same(expected, caps)
    stats = fxprobe.open_captures(tmp_path / "stats")
    assert isinstance(stats.forward(2)[stats.names[1]], fxprobe.Stats)
    with pytest.raises(fxprobe.DiskError, match="do not concatenate"):
        stats[stats.names[1]]


def test_parameters_and_inputs_are_copied_before_they_change(tmp_path: Path) -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    gate = threading.Event()
    real = _shards.Shard.add

    def held(self: Any, job: Any, layout: str) -> None:
        gate.wait(10)
        real(self, job, layout)

    model = Scale()
    x = torch.ones(2, 3)
    disk = fxprobe.Disk(tmp_path)
    tapped = fxprobe.tap(model, to=disk)
    try:
        _shards.Shard.add = held  # type: ignore[method-assign]
        with torch.no_grad():
            tapped(x)
            x.mul_(5)  # the caller reuses its input buffer
            model.w.mul_(7)  # an optimizer step
        gate.set()
        tapped.remove()
    finally:
        _shards.Shard.add = real  # type: ignore[method-assign]
    got = fxprobe.open_captures(tmp_path).forward(0)
    assert torch.equal(got["x"], torch.ones(2, 3))
    assert torch.equal(got["w"], torch.ones(3))
    assert torch.equal(got["mul"], torch.ones(2, 3))


class Aliases(nn.Module):
    """Sites whose values share storage with the input or a parameter, none of them copies."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, 3))
        self.id = nn.Identity()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.view(-1)
        c = x.contiguous()  # x itself
        i = self.id(x)  # x itself
        wt = self.w.t()  # a view of a parameter
        return self.lin(c) + v.sum() + i + wt.sum()


def held_writer(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold the writer thread before it writes anything, until the returned event is set."""
    gate = threading.Event()
    real = _shards.Shard.add

    def held(self: Any, job: Any, layout: str) -> None:
        gate.wait(10)
        real(self, job, layout)

    monkeypatch.setattr(_shards.Shard, "add", held)
    return gate


@pytest.mark.parametrize("tracer", ["fx", "hooks"])
def test_values_sharing_storage_with_inputs_or_parameters_are_copied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tracer: str) -> None:
    model = Aliases()
    buf = torch.arange(12.0).reshape(4, 3)
    x = buf[1:3]  # the batch is a view of the caller's buffer
    with torch.no_grad():  # the values, computed by hand
        expected = {"view": x.reshape(-1).clone(), "contiguous": x.clone(), "id": x.clone(),
                    "t": torch.ones(3, 3), "lin": (x.clone(),)}
    _, ref = hook_values(model, ["id"], x)
    assert torch.equal(ref["id"], expected["id"])
    gate = held_writer(monkeypatch)
    names = ["view", "contiguous", "id", "t"] if tracer == "fx" else ["id"]
    with torch.no_grad():
        tapped = fxprobe.tap(model, names, tracer=tracer, to=fxprobe.Disk(tmp_path / "out"))
        first = fxprobe.tap(model, "lin", capture="input", tracer=tracer,
                            to=fxprobe.Disk(tmp_path / "in"))
        tapped(x)
        first(x)
        buf.fill_(7.0)  # the caller reuses its input buffer for the next batch
        model.w.mul_(5.0)  # an optimizer step
    gate.set()
    tapped.remove()
    first.remove()
    got = fxprobe.open_captures(tmp_path / "out").forward(0)
    assert list(got) == names
    for name in names:
        assert torch.equal(got[name], expected[name]), name
    assert same(fxprobe.open_captures(tmp_path / "in").forward(0)["lin"], expected["lin"])


def test_inputs_in_keyword_arguments_and_containers_are_copied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class TwoInputs(nn.Module):
        def forward(self, x: torch.Tensor, rest: dict[str, torch.Tensor]) -> torch.Tensor:
            return x.view(-1) + rest["y"].flatten()

    x, y = torch.ones(2, 3), torch.full((2, 3), 2.0)
    gate = held_writer(monkeypatch)
    with torch.no_grad():
        tapped = fxprobe.tap(TwoInputs(), ["view", "flatten"], to=fxprobe.Disk(tmp_path))
        tapped(x, rest={"y": y, "unused": torch.eye(3).to_sparse()})  # a storage-less tensor
        x.fill_(7.0)
        y.fill_(7.0)
    gate.set()
    tapped.remove()
    got = fxprobe.open_captures(tmp_path).forward(0)
    assert torch.equal(got["view"], torch.ones(6))
    assert torch.equal(got["flatten"], torch.full((6,), 2.0))


def test_the_forward_waits_only_when_the_queue_is_full(tmp_path: Path) -> None:
    gate = threading.Event()
    real = _shards.Shard.add

    def held(self: Any, job: Any, layout: str) -> None:
        gate.wait(10)
        real(self, job, layout)

    model = nn.Linear(4, 4)
    tapped = fxprobe.tap(model, to=fxprobe.Disk(tmp_path, queue=2))
    done = []

    def produce() -> None:
        with torch.no_grad():
            for x in inputs(6, (2, 4)):
                tapped(x)
                done.append(1)

    _shards.Shard.add = held  # type: ignore[method-assign]
    try:
        t = threading.Thread(target=produce)
        t.start()
        for _ in range(200):  # until three forwards went through (bounded)
            if len(done) >= 3:
                break
            t.join(0.05)
        t.join(0.3)
        # One forward in the writer (held), two queued; the fourth waits for room.
        assert len(done) == 3 and t.is_alive()
        assert len(tapped._sink._jobs) == 2  # noqa: SLF001
        gate.set()
        t.join(10)
    finally:
        gate.set()
        _shards.Shard.add = real  # type: ignore[method-assign]
    tapped.remove()
    assert len(done) == 6 and len(fxprobe.open_captures(tmp_path)) == 6


def test_flush_makes_forwards_visible_and_append_continues(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    xs = inputs(5, (3, 4))
    ref = fxprobe.tap(model, keep="all")
    disk = fxprobe.Disk(tmp_path)
    tapped = fxprobe.tap(model, to=disk)
    with torch.no_grad():
        for x in xs[:2]:
            ref(x)
            tapped(x)
        disk.flush()
        assert len(fxprobe.open_captures(tmp_path)) == 2
        tapped(xs[2])
        ref(xs[2])
    tapped.remove()
    with pytest.raises(fxprobe.DiskError, match="already holds captures"):
        fxprobe.Disk(tmp_path)
    with torch.no_grad(), fxprobe.tap(model, to=fxprobe.Disk(tmp_path, mode="append")) as again:
        for x in xs[3:]:
            ref(x)
            again(x)
    check_same([dict(f.items()) for f in ref.history], fxprobe.open_captures(tmp_path))
    with fxprobe.Disk(tmp_path, mode="overwrite"):
        pass
    with pytest.raises(fxprobe.DiskError, match="holds no captures"):
        fxprobe.open_captures(tmp_path)


def test_ranks_write_one_directory_each(tmp_path: Path) -> None:
    model = nn.Linear(3, 3)
    per_rank = {}
    for rank in (0, 1):
        expected, _ = run_both(model, tmp_path, inputs(2, (2, 3), seed=rank),
                               disk={"rank": rank})
        per_rank[rank] = expected
    check_same(per_rank[0] + per_rank[1], fxprobe.open_captures(tmp_path))  # all, in order
    for rank, expected in per_rank.items():
        check_same(expected, fxprobe.open_captures(tmp_path, rank=rank))


def test_the_worked_example_in_the_docs_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import re

    text = (ROOT / "docs/disk.md").read_text().split("## Harvest activations")[0]
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for code in blocks:
        exec(compile(code, "docs/disk.md", "exec"), {"__name__": "__docs__"})
    assert "('1',) 10" in capsys.readouterr().out


def test_forwards_from_several_threads_are_all_kept(tmp_path: Path) -> None:
    disk = fxprobe.Disk(tmp_path, shard_size=200, queue=2)

    def produce(k: int) -> None:
        for i in range(6):
            disk.write({"v": torch.full((3,), float(10 * k + i))})

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    disk.close()
    caps = fxprobe.open_captures(tmp_path)
    got = sorted(float(caps.forward(i)["v"][0]) for i in range(len(caps)))
    assert got == sorted(float(10 * k + i) for k in range(3) for i in range(6))
    by_thread = [[v for v in caps["v"][::3].tolist() if v // 10 == k] for k in range(3)]
    assert all(vs == sorted(vs) for vs in by_thread)  # each thread's forwards in its order


def test_generate_writes_one_forward_per_step(tmp_path: Path) -> None:
    """tapped.generate() with to=Disk: one captured forward per decoding step of that call,
    each equal to what a cloning hook saw in model.generate()."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = tf.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    expected = model.generate(ids, **kw)
    hook.remove()
    with torch.no_grad(), fxprobe.tap(model, ops="lm_head", to=fxprobe.Disk(tmp_path)) as tapped:
        got = tapped.generate(ids, **kw)
    assert torch.equal(got, expected)
    caps = fxprobe.open_captures(tmp_path)
    assert len(caps) == len(seen) == 4  # the prompt, then one forward per new token
    for i, logits in enumerate(seen):
        assert torch.equal(caps.forward(i)["lm_head"], logits), i

