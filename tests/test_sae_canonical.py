"""Captures are read by canonical names (``blocks.0.resid_post``) as well as by the model's own.

Disk stores the canonical names of the sites it writes in ``index.json``; reading by either
name gives the same rows, equal to a forward hook on an untapped copy. Older captures (no
canonical names stored) still read by the model's own names and say so for a canonical one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import fxprobe

tf = pytest.importorskip("transformers")


def gpt2() -> torch.nn.Module:
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(config).eval()


IDS = torch.randint(2, 99, (2, 5), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("canonical")
    with torch.no_grad(), fxprobe.tap(gpt2(), ops=["blocks.0.resid_post", "blocks.1.mlp_out"],
                                      to=fxprobe.Disk(path)) as tapped:
        tapped(input_ids=IDS)
        tapped(input_ids=IDS + 1)
    return path


def test_rows_by_canonical_name_equal_hooks(written: Path) -> None:
    ids = IDS
    caps = fxprobe.open_captures(written)
    assert caps.canonical["blocks.0.resid_post"] == "transformer.h.0"
    assert caps.resolve("blocks.0.resid_post") in caps.names
    assert "blocks.1.mlp_out" in caps
    by_canon = caps.dataset("blocks.0.resid_post")
    by_own = caps.dataset("transformer.h.0")
    assert by_canon.names == by_own.names
    model = gpt2()
    seen: list[torch.Tensor] = []
    model.transformer.h[0].register_forward_hook(
        lambda m, a, o: seen.append((o[0] if isinstance(o, tuple) else o).clone()))
    with torch.no_grad():
        model(input_ids=ids)
        model(input_ids=ids + 1)
    expected = torch.cat([s.flatten(0, 1) for s in seen])
    torch.testing.assert_close(by_canon[list(range(len(by_canon)))], expected)
    torch.testing.assert_close(caps.forward(1)["blocks.0.resid_post"], seen[1])
    torch.testing.assert_close(caps["blocks.0.resid_post"], torch.cat(seen))
    with pytest.raises(fxprobe.UnknownSiteError, match="blocks.0.resid_post"):
        caps.dataset("blocks.0.resid_pots")


def test_older_captures_read_by_own_names_and_say_so(written: Path, tmp_path: Path) -> None:
    tmp_path = Path(shutil.copytree(written, tmp_path / "old"))
    index = json.loads((tmp_path / "index.json").read_text())
    del index["canonical"]  # as written before canonical names were stored
    (tmp_path / "index.json").write_text(json.dumps(index))
    caps = fxprobe.open_captures(tmp_path)
    assert caps.canonical == {} and len(caps.dataset("transformer.h.0")) == 20
    with pytest.raises(fxprobe.UnknownSiteError, match="store no canonical names"):
        caps.dataset("blocks.0.resid_post")
