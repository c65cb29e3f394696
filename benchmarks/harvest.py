"""Harvesting activations for training (an SAE, a probe): write while the model runs, read back
shuffled. Everything is measured in one run, medians of interleaved rounds.

Run ``python -m benchmarks.harvest`` (``--quick`` for a smoke run); it writes
``benchmarks/results/cpu/harvest.json`` and ``harvest.md``.

- model: a GPT-2-small layout built from a config (12 blocks, width 768; random weights),
  batch 8 x 128 tokens; the output of every block (the residual stream after it) is kept.
- write: per forward, (a) ``fxprobe.tap(..., to="cpu")`` (values kept in memory, the
  reference), (b) ``to=fxprobe.Disk(dir)`` (the writer thread; its final flush counted), (c)
  the common baseline: forward hooks that ``torch.save`` each batch's values to a file.
- read one epoch of token rows, shuffled, batches of 4096: (d) ``DataLoader(ds,
  batch_size=4096, shuffle=True)`` over ``open_captures(dir).dataset(...)``, (e) the same
  dataset read a batch at a time (``BatchSampler`` -> ``ds[rows]``), (f) the shards read with
  ``safetensors`` directly (``load_file``, concatenate, ``randperm``, index), (g) the baseline:
  ``torch.load`` every file, concatenate, shuffle in memory.
- peak memory: each read treatment in a fresh process, peak RSS growth.
- the reader table (``--readers``): one site of ``--read-forwards`` forwards of [8, 128, width]
  fp32 written with ``Disk.write`` (GPT-2-small width: 75 forwards = 76,800 rows, 236 MB), one
  shuffled epoch in batches of 4096 by every reader: ``DataLoader(ds, batch_size, shuffle=True)``
  (and ``num_workers=2``), ``ds.loader(batch_size)`` (and ``num_workers=2``), the
  ``BatchSampler`` path, ``safetensors.load_file`` of the shards + a permutation, and the floor,
  a NumPy memmap of the same rows in one file + a permutation (and the same with each batch's
  rows sorted, as ``ds.loader`` reads them). Each reader in a fresh process,
  cold (its files dropped from the page cache with ``posix_fadvise(DONTNEED)`` first) and warm
  (read once before); rows/s of its first epoch and of a second one, and its peak RSS growth.
  The disk's sequential read rate: ``dd`` of the shard, cold. Writer throughput before/after:
  ``--baseline-tree DIR`` (an fxprobe tree, e.g. ``git archive f3d4cd4``) and this one write the
  same forwards with ``Disk.write`` in interleaved rounds, each in a fresh process. A tiny SAE
  (``benchmarks.stream.SAE``) trained on the rows: rows/s of its step alone, of ``ds.loader``
  alone, and of the loader (without and with threads) feeding it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fxprobe

RESULTS = Path(__file__).resolve().parent / "results" / "cpu"
BLOCKS = re.compile(r"^h\.\d+$")  # GPT2Model: the blocks are h.0, h.1, ...


def gpt2(layers: int, width: int, heads: int) -> nn.Module:
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=50257,
                        n_positions=1024)
    return GPT2Model(config).eval()


def hidden(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def write_rounds(model: nn.Module, ids: torch.Tensor, base: Path, rounds: int, per: int
                 ) -> dict[str, list[float]]:
    """Seconds per forward of each treatment, ``per`` forwards a round, rounds interleaved.
    Each tapped module is made (and captured by dynamo) once, before the rounds; a Disk round
    ends with ``flush()`` (everything on disk), counted."""
    cpu = fxprobe.tap(model, ops=BLOCKS, to="cpu")
    disk = fxprobe.Disk(base / "written")
    on_disk = fxprobe.tap(model, ops=BLOCKS, to=disk)
    times: dict[str, list[float]] = {"to_cpu": [], "to_disk": [], "hooks_torch_save": []}
    with torch.no_grad():
        cpu(ids)  # captures outside the timing
        on_disk(ids)
        disk.flush()
        model(ids)
    saved = base / "saved"
    saved.mkdir()
    step = 0
    for r in range(rounds):
        order = list(times)
        order = order[r % 3:] + order[:r % 3]
        for kind in order:
            with torch.no_grad():
                start = time.perf_counter()
                if kind == "to_cpu":
                    for _ in range(per):
                        cpu(ids)
                elif kind == "to_disk":
                    for _ in range(per):
                        on_disk(ids)
                    disk.flush()
                else:
                    seen: dict[str, torch.Tensor] = {}
                    hooks = [blk.register_forward_hook(
                        lambda m, i, o, k=k, s=seen: s.__setitem__(k, hidden(o).detach().clone()))
                        for k, blk in enumerate(model.h)]
                    try:
                        for _ in range(per):
                            model(ids)
                            torch.save(dict(seen), saved / f"batch-{step:05d}.pt")
                            step += 1
                    finally:
                        for h in hooks:
                            h.remove()
                times[kind].append((time.perf_counter() - start) / per)
    on_disk.remove()
    shutil.rmtree(base / "written", ignore_errors=True)
    shutil.rmtree(saved, ignore_errors=True)
    return times


def harvest_once(model: nn.Module, ids: torch.Tensor, base: Path, forwards: int) -> None:
    """The data the read treatments share: fxprobe shards and the baseline's files."""
    with torch.no_grad(), fxprobe.tap(model, ops=BLOCKS,
                                      to=fxprobe.Disk(base / "acts")) as tapped:
        for _ in range(forwards):
            tapped(ids)
    src = fxprobe.open_captures(base / "acts")
    (base / "pt").mkdir()
    for i in range(len(src)):
        f = src.forward(i)
        torch.save({n: f[n].clone() for n in src.names}, base / "pt" / f"batch-{i:05d}.pt")


READERS = {
    "dataloader": "`DataLoader(ds, batch_size=B, shuffle=True)`",
    "dataloader_w2": "the same, `num_workers=2`",
    "loader": "`ds.loader(B)` (the batch path)",
    "loader_w1": "`ds.loader(B, num_workers=1)`",
    "loader_w2": "`ds.loader(B, num_workers=2)`",
    "batch_sampler": "`DataLoader(ds, batch_size=None, sampler=BatchSampler(RandomSampler(ds), "
                     "B, False))`",
    "safetensors": "`safetensors.torch.load_file` every shard + a permutation",
    "memmap": "NumPy memmap of the same rows + a permutation (the floor)",
    "memmap_sorted": "the same, each batch's rows read in sorted order (as `ds.loader` reads)",
}


def reader_data(base: Path, forwards: int, width: int) -> None:
    """One site, [8, 128, width] fp32 a forward, by ``Disk.write``; the same rows in one raw
    file for the memmap floor."""
    g = torch.Generator().manual_seed(0)
    with fxprobe.Disk(base / "racts") as d, open(base / "rows.raw", "wb") as raw:
        for _ in range(forwards):
            v = torch.randn(8, 128, width, generator=g)
            d.write({"h": v})
            raw.write(v.numpy().tobytes())


def drop_cache(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (dirty pages written first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def reader_files(base: Path) -> list[Path]:
    return [*sorted((base / "racts").glob("*.safetensors")), base / "rows.raw"]


def reader_child(kind: str, base: str, batch: int, width: int) -> None:
    """Two shuffled epochs by reader ``kind``; prints rows/s of each and peak RSS growth."""
    import numpy as np
    from safetensors.torch import load_file
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    torch.manual_seed(0)
    start_rss = peak_rss_mib()
    start_anon = anon_mib()
    anon = 0.0
    rates = []
    ds = None
    for _ in range(2):
        start = time.perf_counter()
        rows = 0
        anon = max(anon, anon_mib())
        if kind in ("memmap", "memmap_sorted", "safetensors"):
            if kind.startswith("memmap"):
                allrows: Any = np.memmap(Path(base, "rows.raw"), dtype=np.float32, mode="r")
                allrows = allrows.reshape(-1, width)
            else:
                parts = []
                for f in sorted(Path(base, "racts").glob("*.safetensors")):
                    t = load_file(f)
                    parts += [t[k] for k in sorted(t, key=_order) if k.split("/")[1:2] == ["h"]]
                allrows = torch.cat([p.reshape(-1, width) for p in parts]).numpy()
            perm = torch.randperm(allrows.shape[0]).numpy()
            for i in range(0, len(perm), batch):
                part = perm[i:i + batch]
                b = torch.from_numpy(allrows[np.sort(part) if kind == "memmap_sorted" else part])
                rows += b.shape[0]
                anon = max(anon, anon_mib())
        else:
            if ds is None:
                ds = fxprobe.open_captures(Path(base, "racts")).dataset("h")
            if kind.startswith("dataloader"):
                loader: Any = DataLoader(ds, batch_size=batch, shuffle=True,
                                         num_workers=2 if kind.endswith("w2") else 0)
            elif kind.startswith("loader"):
                loader = ds.loader(batch, num_workers=int(kind[-1]) if "_w" in kind else 0)
            else:
                loader = DataLoader(ds, batch_size=None,
                                    sampler=BatchSampler(RandomSampler(ds), batch, False))
            for b in loader:
                rows += b.shape[0]
                anon = max(anon, anon_mib())
        rates.append(rows / (time.perf_counter() - start))
    print(json.dumps({"first": rates[0], "second": rates[1],
                      "peak_growth_mib": peak_rss_mib() - start_rss,
                      "anon_growth_mib": anon - start_anon}))


def dd_rate(path: Path) -> float:
    """MB/s of ``dd`` reading ``path`` sequentially from the disk (cache dropped first)."""
    drop_cache([path])
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M"], check=True,
                   capture_output=True)
    return path.stat().st_size / (time.perf_counter() - start) / 1e6


def write_child(forwards: int, width: int, out: str) -> None:
    """Seconds for ``Disk.write`` of ``forwards`` forwards (fsync on) and close."""
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(8, 128, width, generator=g) for _ in range(4)]
    start = time.perf_counter()
    with fxprobe.Disk(out) as d:
        for i in range(forwards):
            d.write({"h": values[i % 4]})
    print(json.dumps({"seconds": time.perf_counter() - start,
                      "bytes": forwards * values[0].nbytes}))


def child(args: list[str], tree: str | None = None) -> dict[str, Any]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree
    out = subprocess.run([sys.executable, "-m", "benchmarks.harvest", *args],
                         capture_output=True, text=True, timeout=1800, check=True,
                         cwd=Path(__file__).resolve().parent.parent, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def readers(base: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The reader table: every reader cold and warm, rounds interleaved; dd; write rates."""
    reader_data(base, args.read_forwards, args.width)
    shard_bytes = sum(f.stat().st_size for f in (base / "racts").glob("*.safetensors"))
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        k: {"cold": [], "warm": []} for k in READERS}
    dd: list[float] = []
    kinds = list(READERS)
    for r in range(args.read_rounds):
        dd.append(dd_rate(reader_files(base)[0]))
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            for state in ("cold", "warm"):
                if state == "cold":
                    drop_cache(reader_files(base))
                else:
                    for f in reader_files(base):
                        with open(f, "rb") as fh:
                            while fh.read(1 << 24):
                                pass
                results[kind][state].append(child(
                    ["--reader-child", kind, str(base), str(args.read_batch), str(args.width)]))
    writes: dict[str, list[float]] = {"before": [], "after": []}
    trees = {"after": str(Path(__file__).resolve().parent.parent)}
    if args.baseline_tree:
        trees["before"] = args.baseline_tree
    for r in range(args.write_rounds):
        for label, tree in (list(trees.items()) if r % 2 else list(trees.items())[::-1]):
            out = base / f"w-{label}-{r}"
            got = child(["--write-child", str(args.write_forwards), str(args.width), str(out)],
                        tree)
            writes[label].append(got["bytes"] / got["seconds"] / 1e6)
            shutil.rmtree(out, ignore_errors=True)
    sae = sae_rounds(base, args)
    return {"rows": args.read_forwards * 8 * 128, "width": args.width, "sae_rows_per_s": sae,
            "sae_steps": args.sae_steps,
            "site_bytes": args.read_forwards * 8 * 128 * args.width * 4,
            "shard_bytes": shard_bytes, "batch": args.read_batch, "dd_mb_s": dd,
            "readers": results, "write_mb_s": writes}


SAE_KINDS = {
    "sae_alone": "tiny SAE step alone (batches already in memory)",
    "loader_alone": "`ds.loader(B)` alone, as many batches",
    "loader_into_sae": "`ds.loader(B)` feeding the SAE",
    "loader_w2_into_sae": "`ds.loader(B, num_workers=2)` feeding the SAE",
}


def sae_rounds(base: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """Rows/s of a tiny SAE (``benchmarks.stream.SAE``: width -> 4 x width, Adam) trained on
    ``--sae-steps`` batches of the reader table's rows, against the step alone and the loader
    alone; warm page cache, one process, kinds interleaved over ``--read-rounds`` rounds."""
    from .stream import SAE, consume

    ds = fxprobe.open_captures(base / "racts").dataset("h")
    torch.manual_seed(0)
    sae = SAE(args.width)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-4)

    def step(x: torch.Tensor) -> None:
        sae.step(x, opt)

    held = [ds[list(range(i * args.read_batch, (i + 1) * args.read_batch))]
            for i in range(args.sae_steps)]
    kinds = {
        "sae_alone": lambda: consume(held, step),
        "loader_alone": lambda: consume(ds.loader(args.read_batch), None, args.sae_steps),
        "loader_into_sae": lambda: consume(ds.loader(args.read_batch), step, args.sae_steps),
        "loader_w2_into_sae": lambda: consume(ds.loader(args.read_batch, num_workers=2), step,
                                              args.sae_steps),
    }
    for fn in kinds.values():  # the maps opened and checked, Adam's state made
        fn()
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    order = list(kinds)
    for r in range(args.read_rounds):
        for k in order[r % len(order):] + order[:r % len(order)]:
            start = time.perf_counter()
            rows = kinds[k]()
            rates[k].append(rows / (time.perf_counter() - start))
    return rates


def read_child(kind: str, base: str, name: str, batch: int) -> None:
    """One epoch of shuffled token rows of site ``name``; prints seconds, rows, peak RSS."""
    from safetensors.torch import load_file
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    torch.manual_seed(0)
    start_rss = peak_rss_mib()
    start = time.perf_counter()
    rows = 0
    check = 0.0
    if kind in ("dataloader", "batch_sampler"):
        ds = fxprobe.open_captures(base + "/acts").dataset(name, rows="tokens")
        if kind == "dataloader":
            loader = DataLoader(ds, batch_size=batch, shuffle=True)
        else:
            loader = DataLoader(ds, batch_size=None,
                                sampler=BatchSampler(RandomSampler(ds), batch, False))
        for b in loader:
            rows += b.shape[0]
            check += float(b[0, 0])
    elif kind == "safetensors":
        index = json.loads(Path(base, "acts", "index.json").read_text())
        parts = []
        for shard in index["shards"]:
            tensors = load_file(Path(base, "acts", shard["file"]))
            parts += [t for k, t in sorted(tensors.items(), key=lambda kv: _order(kv[0]))
                      if k.split("/")[1:2] == [name]]
        allrows = torch.cat([p.reshape(-1, p.shape[-1]) for p in parts])
        perm = torch.randperm(allrows.shape[0])
        for i in range(0, allrows.shape[0], batch):
            b = allrows[perm[i:i + batch]]
            rows += b.shape[0]
            check += float(b[0, 0])
    else:  # torch.load every batch file, concatenate, shuffle in memory
        files = sorted(Path(base, "pt").glob("batch-*.pt"))
        loaded = [torch.load(f)[name] for f in files]
        allrows = torch.cat([v.reshape(-1, v.shape[-1]) for v in loaded])
        perm = torch.randperm(allrows.shape[0])
        for i in range(0, allrows.shape[0], batch):
            b = allrows[perm[i:i + batch]]
            rows += b.shape[0]
            check += float(b[0, 0])
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "rows": rows,
                      "peak_growth_mib": peak_rss_mib() - start_rss}))


def _order(key: str) -> tuple[int, str]:
    head, _, rest = key.partition("/")
    return (int(head), rest) if head.isdigit() else (-1, key)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def anon_mib() -> float:
    """This process's resident memory that no file backs (``/proc/self/statm``: resident
    minus shared pages): the reader's own memory, without the pages of the files it maps."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE") / 2**20


def read(kind: str, base: Path, name: str, batch: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.harvest", "--read-child", kind, str(base), name,
         str(batch)], capture_output=True, text=True, timeout=900, check=True,
        cwd=Path(__file__).resolve().parent.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the writes")
    ap.add_argument("--per", type=int, default=3, help="forwards per round and treatment")
    ap.add_argument("--forwards", type=int, default=24, help="forwards harvested for reading")
    ap.add_argument("--read-rounds", type=int, default=3)
    ap.add_argument("--read-batch", type=int, default=4096)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--read-child", nargs=4, metavar=("KIND", "DIR", "NAME", "BATCH"))
    ap.add_argument("--readers-only", action="store_true",
                    help="only the reader table and the writer before/after")
    ap.add_argument("--read-forwards", type=int, default=75,
                    help="forwards of [8, 128, width] in the reader table (75: 76,800 rows)")
    ap.add_argument("--sae-steps", type=int, default=4,
                    help="SAE steps (batches) timed per round in the reader table")
    ap.add_argument("--write-rounds", type=int, default=5)
    ap.add_argument("--write-forwards", type=int, default=24)
    ap.add_argument("--baseline-tree", default=None,
                    help="an fxprobe source tree to compare the writer with")
    ap.add_argument("--reader-child", nargs=4, metavar=("KIND", "DIR", "BATCH", "WIDTH"))
    ap.add_argument("--write-child", nargs=3, metavar=("FORWARDS", "WIDTH", "DIR"))
    args = ap.parse_args(argv)
    if args.read_child:
        kind, d, name, b = args.read_child
        read_child(kind, d, name, int(b))
        return
    if args.reader_child:
        kind, d, b, w = args.reader_child
        reader_child(kind, d, int(b), int(w))
        return
    if args.write_child:
        n, w, d = args.write_child
        write_child(int(n), int(w), d)
        return
    if args.quick:
        args.layers, args.width, args.heads, args.seq = 2, 128, 4, 32
        args.rounds, args.per, args.forwards, args.read_rounds = 3, 2, 6, 2
        args.read_batch = 256
        args.read_forwards, args.write_rounds, args.write_forwards = 4, 2, 4
        args.sae_steps = 3
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fxprobe-harvest-"))
    base.mkdir(parents=True, exist_ok=True)
    if args.readers_only:
        try:
            load = [os.getloadavg()[0]]
            table = readers(base, args)
            load.append(os.getloadavg()[0])
        finally:
            if not args.dir:
                shutil.rmtree(base, ignore_errors=True)
        table["loadavg_before_after"] = load
        table["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                         capture_output=True, text=True).stdout.strip()
        table["machine"] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cpus": os.cpu_count(), "platform": platform.platform()}
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = "harvest-readers-quick" if args.quick else "harvest-readers"
        (RESULTS / f"{out}.json").write_text(json.dumps(table, indent=1))
        md = readers_markdown(table)
        (RESULTS / f"{out}.md").write_text(md)
        print(md)
        return
    try:
        model = gpt2(args.layers, args.width, args.heads)
        ids = torch.randint(0, 50257, (args.batch, args.seq),
                            generator=torch.Generator().manual_seed(0))
        load = [os.getloadavg()[0]]
        times = write_rounds(model, ids, base, args.rounds, args.per)
        harvest_once(model, ids, base, args.forwards)
        name = fxprobe.open_captures(base / "acts").names[-1]
        kinds = ("dataloader", "batch_sampler", "safetensors", "torch_load")
        reads: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for r in range(args.read_rounds):
            for kind in kinds[r % 4:] + kinds[:r % 4]:
                reads[kind].append(read(kind, base, name, args.read_batch))
        load.append(os.getloadavg()[0])
        disk_bytes = sum(f.stat().st_size for f in (base / "acts").glob("*.safetensors"))
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    rmed = {k: statistics.median(x["seconds"] for x in v) for k, v in reads.items()}
    record = {
        "what": "harvest: write while the model runs, read back shuffled",
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                    "platform": platform.platform()},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "model": f"GPT-2 layout from a config: {args.layers} blocks, width {args.width}, "
                 f"batch {args.batch} x {args.seq} tokens; every block's output kept",
        "write_s_per_forward": times,
        "write_median_s": med,
        "disk_vs_cpu": med["to_disk"] / med["to_cpu"],
        "hooks_save_vs_cpu": med["hooks_torch_save"] / med["to_cpu"],
        "read_site": name,
        "read_rows": reads["dataloader"][0]["rows"],
        "read_batch": args.read_batch,
        "shard_bytes": disk_bytes,
        "reads": reads,
        "read_median_s": rmed,
        "dataloader_vs_safetensors": rmed["safetensors"] / rmed["dataloader"],
        "batch_sampler_vs_safetensors": rmed["safetensors"] / rmed["batch_sampler"],
        "loadavg_before_after": load,
        "quick": args.quick,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = "harvest-quick" if args.quick else "harvest"
    (RESULTS / f"{out}.json").write_text(json.dumps(record, indent=1))
    md = markdown(record)
    (RESULTS / f"{out}.md").write_text(md)
    print(md)


def markdown(r: dict[str, Any]) -> str:
    m, rm = r["write_median_s"], r["read_median_s"]
    peak = {k: statistics.median(x["peak_growth_mib"] for x in v) for k, v in r["reads"].items()}
    lines = [
        f"### Harvest ({r['model']}; torch {r['machine']['torch']}, "
        f"{r['machine']['cpus']} CPUs, commit {r['commit']})",
        "",
        "| write, per forward | seconds | x `to=\"cpu\"` |",
        "|---|---|---|",
        f"| `fxprobe.tap(..., to=\"cpu\")` (in memory) | {m['to_cpu']:.3f} | 1.00 |",
        f"| `to=fxprobe.Disk(dir)` | {m['to_disk']:.3f} | {r['disk_vs_cpu']:.2f} |",
        f"| forward hooks + `torch.save` per batch | {m['hooks_torch_save']:.3f} | "
        f"{r['hooks_save_vs_cpu']:.2f} |",
        "",
        f"| read one shuffled epoch of `{r['read_site']}` ({r['read_rows']} token rows, "
        f"batches of {r['read_batch']}) | seconds | x safetensors direct | peak RSS growth |",
        "|---|---|---|---|",
    ]
    names = {"dataloader": "`DataLoader(ds, batch_size, shuffle=True)`",
             "batch_sampler": "`DataLoader(ds, batch_size=None, sampler=BatchSampler(...))`",
             "safetensors": "safetensors `load_file`, `randperm`, index",
             "torch_load": "baseline: `torch.load` every file, shuffle in memory"}
    for k, label in names.items():
        lines.append(f"| {label} | {rm[k]:.3f} | {rm['safetensors'] / rm[k]:.2f} of its speed "
                     f"| {peak[k]:.0f} MiB |")
    lines += ["", f"Writes: medians of {len(r['write_s_per_forward']['to_cpu'])} interleaved "
              f"rounds; reads: medians of {len(r['reads']['dataloader'])} rounds, each in a fresh "
              f"process; load average before/after {r['loadavg_before_after'][0]:.1f}/"
              f"{r['loadavg_before_after'][1]:.1f}; shards {r['shard_bytes'] / 2**20:.0f} MiB."]
    return "\n".join(lines) + "\n"


def readers_markdown(t: dict[str, Any]) -> str:
    med = statistics.median
    floor = {s: med(x["second"] for x in t["readers"]["memmap"][s]) for s in ("cold", "warm")}
    dd = med(t["dd_mb_s"])
    lines = [
        f"### Readers: one shuffled epoch of {t['rows']:,} rows x {t['width']} fp32 "
        f"({t['site_bytes'] / 1e6:.0f} MB, one site), batches of {t['batch']} "
        f"(commit {t['commit']}; torch {t['machine']['torch']}, {t['machine']['cpus']} CPUs)",
        "",
        "| reader | warm: 1st epoch rows/s | warm: 2nd epoch | x memmap (2nd) | x sorted memmap "
        "(2nd) | cold: 1st epoch rows/s (MB/s) | peak RSS growth, warm | of it anonymous |",
        "|---|---|---|---|---|---|---|---|",
    ]
    mm2 = med(x["second"] for x in t["readers"]["memmap"]["warm"])
    ms2 = med(x["second"] for x in t["readers"]["memmap_sorted"]["warm"])
    for kind, label in READERS.items():
        warm, cold = t["readers"][kind]["warm"], t["readers"][kind]["cold"]
        w1, w2 = med(x["first"] for x in warm), med(x["second"] for x in warm)
        c1 = med(x["first"] for x in cold)
        rss = med(x["peak_growth_mib"] for x in warm)
        anon = [x["anon_growth_mib"] for x in warm if "anon_growth_mib" in x]
        own = f"{med(anon):.0f} MiB" if anon else "-"
        lines.append(f"| {label} | {w1 / 1e3:.0f}k | {w2 / 1e3:.0f}k | {w2 / mm2:.2f} | "
                     f"{w2 / ms2:.2f} | "
                     f"{c1 / 1e3:.0f}k ({c1 * t['width'] * 4 / 1e6:.0f}) | {rss:.0f} MiB | "
                     f"{own} |")
    sae = {k: med(v) for k, v in t["sae_rows_per_s"].items()}
    lines += ["", f"A tiny SAE ({t['width']} -> {4 * t['width']} -> {t['width']}, ReLU, Adam; "
              f"`benchmarks.stream.SAE`) trained on {t['sae_steps']} batches of {t['batch']} "
              "rows per round, warm cache, on the CPU (no GPU: not run on one):", "",
              "| what | rows/s | x the SAE step alone |", "|---|---|---|"]
    for k, label in SAE_KINDS.items():
        lines.append(f"| {label} | {sae[k]:,.0f} | {sae[k] / sae['sae_alone']:.2f} |")
    w = t["write_mb_s"]
    lines += [
        "",
        f"Disk sequential read (`dd bs=4M` of the shard, cache dropped): {dd:.0f} MB/s "
        f"(per round: {', '.join(f'{x:.0f}' for x in t['dd_mb_s'])}). Memmap floor, 2nd epoch: "
        f"warm {floor['warm'] / 1e3:.0f}k rows/s. Peak RSS counts the pages of the files a "
        "reader maps (the site's bytes, once read); \"of it anonymous\" is the reader's own "
        "memory, the largest seen after any batch (`/proc/self/statm`: resident - shared). "
        f"Medians of {len(t['dd_mb_s'])} interleaved "
        "rounds, each reader in a fresh process; cold = its files dropped from the page cache "
        "(`posix_fadvise(DONTNEED)`) before its first epoch; the 2nd epoch is warm in both. "
        f"Load average before/after {t['loadavg_before_after'][0]:.1f}/"
        f"{t['loadavg_before_after'][1]:.1f} (a shared machine).",
    ]
    if w["after"]:
        after = med(w["after"])
        line = f"Writer (`Disk.write`, fsync on, {t['site_bytes'] // t['rows']} B rows): " \
               f"{after:.0f} MB/s"
        if w["before"]:
            before = med(w["before"])
            line += (f" vs {before:.0f} MB/s before (the baseline tree): {after / before:.2f}x "
                     f"(per round after {', '.join(f'{x:.0f}' for x in w['after'])}; before "
                     f"{', '.join(f'{x:.0f}' for x in w['before'])})")
        lines.append("")
        lines.append(line + ".")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
