"""fxprobe.Disk and open_captures, checked against keep="all" in memory and safetensors' reader."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
from reference import hook_values, same
from safetensors.torch import load_file
from torch import nn

import fxprobe
from fxprobe.sinks import index as _index
from fxprobe.sinks import shards as _shards

ROOT = Path(__file__).resolve().parent.parent


def run_both(model: nn.Module, path: Path, inputs: list[torch.Tensor], **kw: Any
             ) -> tuple[list[Any], fxprobe.Captures]:
    """The same forwards through keep="all" (the reference) and to=Disk; the reader's view."""
    disk_kw = kw.pop("disk", {})
    ref = fxprobe.tap(model, keep="all", **kw)
    with torch.no_grad(), fxprobe.tap(model, to=fxprobe.Disk(path, **disk_kw), **kw) as tapped:
        for x in inputs:
            ref(x)
            tapped(x)
    return ([dict(f.items()) for f in ref.history],
            fxprobe.open_captures(path, rank=disk_kw.get("rank")))


def check_same(expected: list[dict[str, Any]], caps: fxprobe.Captures) -> None:
    assert len(caps) == len(expected)
    for i, frame in enumerate(expected):
        got = caps.forward(i)
        assert list(got) == list(frame)
        for name, value in frame.items():
            assert same(got[name], value), (i, name)


def inputs(n: int, shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


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


def test_another_models_captures_are_refused_and_kept(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    expected, _ = run_both(model, tmp_path, inputs(2, (3, 4)))
    before = sorted(os.listdir(tmp_path))
    other = nn.Sequential(nn.Linear(4, 5), nn.ReLU())
    tapped = fxprobe.tap(other, to=fxprobe.Disk(tmp_path, mode="append"))
    with pytest.raises(fxprobe.DiskError, match="another model.*site '0' differs"), \
            torch.no_grad():
        tapped(torch.randn(3, 4))  # refused at the first forward, before anything is queued
    with pytest.raises(fxprobe.DiskError, match="another model"), torch.no_grad():
        tapped(torch.randn(3, 4))  # and at every later one
    tapped.remove()
    assert sorted(os.listdir(tmp_path)) == before
    check_same(expected, fxprobe.open_captures(tmp_path))


def test_full_disk_keeps_what_was_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    xs = inputs(40, (8, 64))
    real = _shards.Shard._append
    budget = [60_000]  # bytes of tensor data the "disk" takes

    def append(self: Any, key: str, code: str, shape: list[int], data: Any) -> None:
        n = len(data) if isinstance(data, bytes) else data.nbytes
        budget[0] -= n
        if budget[0] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, key, code, shape, data)

    monkeypatch.setattr(_shards.Shard, "_append", append)
    ref = fxprobe.tap(model, keep="all")
    tapped = fxprobe.tap(model, to=fxprobe.Disk(tmp_path, shard_size=10_000))
    handed = 0
    with pytest.raises(fxprobe.DiskError, match="No space left.*intact") as info:
        with torch.no_grad():
            for x in xs:
                ref(x)
                tapped(x)  # raises once the writer has failed, handing nothing over
                handed += 1
            tapped.remove()
    assert isinstance(info.value, OSError)
    caps = fxprobe.open_captures(tmp_path)
    assert 0 < len(caps) < len(xs)
    assert f"The {len(caps)} forwards" in str(info.value)
    assert f"the {handed - len(caps)} forward(s) after them were lost" in str(info.value)
    check_same([dict(f.items()) for f in ref.history][: len(caps)], caps)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".partial")]


def test_a_failing_index_write_keeps_the_committed_forwards(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = _index.write_json
    calls = [0]

    def write_json(path: Path, data: Any, fsync: bool) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data, fsync)

    monkeypatch.setattr(_index, "write_json", write_json)
    model = nn.Linear(8, 8)
    xs = inputs(5, (4, 8))
    ref = fxprobe.tap(model, keep="all")
    tapped = fxprobe.tap(model, to=fxprobe.Disk(tmp_path, shard_size=1))  # a shard a forward
    with pytest.raises(fxprobe.DiskError, match=r"The 2 forwards .* intact.* 3 forward\(s\)"):
        with torch.no_grad():
            for x in xs:
                ref(x)
                tapped(x)
            tapped.remove()
    caps = fxprobe.open_captures(tmp_path)
    check_same([dict(f.items()) for f in ref.history][:2], caps)
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("shard")) == [
        "shard-000000.safetensors", "shard-000001.safetensors"]


def test_a_crash_loses_at_most_the_unfinished_shard(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        import fxprobe
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        tapped = fxprobe.tap(model, to=fxprobe.Disk({str(tmp_path)!r}, shard_size=3000))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for i in range(7):
                tapped(torch.randn(4, 16, generator=g))
            tapped._sink.flush()
            for i in range(2):
                tapped(torch.randn(4, 16, generator=g))
        os._exit(3)  # no close, no atexit: the shard being written is left unfinished
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
    ref = fxprobe.tap(model, keep="all")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(9):
            ref(torch.randn(4, 16, generator=g))
    expected = [dict(f.items()) for f in ref.history]
    caps = fxprobe.open_captures(tmp_path)
    assert 7 <= len(caps) <= 9  # everything flushed survived; the rest is whole or absent
    check_same(expected[: len(caps)], caps)
    with torch.no_grad(), fxprobe.tap(model, to=fxprobe.Disk(tmp_path, mode="append")) as t:
        t(torch.randn(4, 16, generator=g))
    assert len(fxprobe.open_captures(tmp_path)) == len(caps) + 1
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".partial")]


def test_interpreter_exit_flushes_and_commits(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        import fxprobe
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        tapped = fxprobe.tap(model, to=fxprobe.Disk({str(tmp_path)!r}))
        with torch.no_grad():
            for i in range(5):
                tapped(torch.full((2, 4), float(i)))
        # no remove(), no close(): leaving the interpreter must commit the 5 forwards
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    caps = fxprobe.open_captures(tmp_path)
    assert len(caps) == 5
    with torch.no_grad():
        for i in range(5):
            assert torch.equal(caps.forward(i)["linear"], model(torch.full((2, 4), float(i))))


def test_bad_directories_and_options(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(fxprobe.DiskError, match="cannot write captures to"):
        fxprobe.Disk(blocker / "acts")
    disk = fxprobe.Disk(tmp_path / "a")
    with pytest.raises(fxprobe.DiskError, match="being written by another"):
        fxprobe.Disk(tmp_path / "a", mode="append")
    with pytest.raises(fxprobe.ConfigError, match="keep='all'"):
        fxprobe.tap(nn.Linear(2, 2), to=disk, keep="all")
    disk.close()
    with pytest.raises(fxprobe.ConfigError, match="closed"):
        fxprobe.tap(nn.Linear(2, 2), to=disk)
    with fxprobe.Disk(tmp_path / "c") as odd:
        odd_values = [(torch.eye(2).to_sparse(), "sparse"),
                      (torch.ones(2, dtype=torch.cfloat), "complex"), (object(), "object")]
        for value, what in odd_values:
            with pytest.raises(fxprobe.ConfigError, match=what):
                odd.write({"site": value})
        odd.write({"site": torch.ones(2)})  # a refused value leaves no gap in the numbering
    caps = fxprobe.open_captures(tmp_path / "c")
    assert len(caps) == 1 and torch.equal(caps.forward(0)["site"], torch.ones(2))
    for bad in ({"mode": "w"}, {"queue": 0}, {"shard_size": "lots"}, {"rank": -1}):
        with pytest.raises(fxprobe.ConfigError):
            fxprobe.Disk(tmp_path / "b", **bad)
    with pytest.raises(fxprobe.DiskError, match="holds no captures"):
        fxprobe.open_captures(tmp_path / "b")


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


def test_exception_in_the_with_block_still_commits(tmp_path: Path) -> None:
    model = nn.Linear(3, 3)
    xs = inputs(3, (2, 3))
    with pytest.raises(ZeroDivisionError), torch.no_grad():
        with fxprobe.tap(model, to=fxprobe.Disk(tmp_path)) as tapped:
            for x in xs:
                tapped(x)
            1 / 0  # noqa: B018
    caps = fxprobe.open_captures(tmp_path)
    assert len(caps) == 3
    with torch.no_grad():
        assert torch.equal(caps.forward(2)[caps.names[-1]], model(xs[2]))


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


class SmallDisk:
    """A file on a disk with ``budget`` free bytes, allocated in 4 KiB blocks as written (a
    seek over a range leaves a hole that takes no space until it is written)."""

    def __init__(self, real: Any, budget: list[int]) -> None:
        self.real = real
        self.budget = budget
        self.blocks: set[int] = set()

    def write(self, data: Any) -> int:
        n = len(data) if isinstance(data, bytes) else data.nbytes
        pos = self.real.tell()
        new = set(range(pos // 4096, (pos + n + 4095) // 4096)) - self.blocks if n else set()
        if len(new) * 4096 > self.budget[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.budget[0] -= len(new) * 4096
        self.blocks |= new
        return int(self.real.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_full_disk_keeps_the_complete_forwards_of_the_shard_being_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    budget = [400_000]  # free bytes: room for some forwards of the one shard, not all

    def small_open(path: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        f = open(path, mode, *args, **kw)  # noqa: SIM115
        return SmallDisk(f, budget) if "w" in mode else f

    monkeypatch.setattr(_shards, "open", small_open, raising=False)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    xs = inputs(100, (16, 64))
    ref = fxprobe.tap(model, keep="all")
    with pytest.raises(fxprobe.DiskError, match="No space left"):
        with torch.no_grad(), fxprobe.tap(model, to=fxprobe.Disk(tmp_path, shard_size="2MB",
                                                                  queue=1)) as tapped:
            for x in xs:
                ref(x)
                tapped(x)
    caps = fxprobe.open_captures(tmp_path)  # the shard's complete forwards were committed
    assert len(caps) >= 10, len(caps)
    check_same([dict(f.items()) for f in ref.history][: len(caps)], caps)
    shard = tmp_path / "shard-000000.safetensors"
    assert len(load_file(shard)) > len(caps)  # safetensors' own reader opens it


def test_inputs_that_cannot_be_written_name_the_capture_option(tmp_path: Path) -> None:
    class Slicer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, 1:3]

    for capture in ("input", "both"):
        with pytest.raises(fxprobe.ConfigError, match=r"'getitem' has a slice.*among its "
                                                      r"inputs.*capture='output'"):
            with fxprobe.tap(Slicer(), ops="getitem", capture=capture,
                             to=fxprobe.Disk(tmp_path / capture)) as tapped:
                tapped(torch.ones(2, 4))
