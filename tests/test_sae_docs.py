"""docs/disk.md's SAE walkthrough (canonical names, a padded Hugging Face model, streaming,
resume) runs as written and prints what it says; its dataset rows are the hooks' rows."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "disk.md"


def test_the_sae_training_walkthrough_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    section = DOCS.read_text().split("## Training a sparse autoencoder")[1]
    section = section.split("## What is written")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    scope: dict[str, Any] = {"__name__": "__docs__"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/disk.md (SAE training {i})", "exec"), scope)
    out = [line for line in capsys.readouterr().out.splitlines() if line]
    assert out == ["transformer.h.1 448", "32", "7 4", "448", "448"]
    # The rows are block 1's output at real, non-BOS tokens (a hook on an untapped copy),
    # scaled by the factor the dataset holds.
    model = scope["transformers"].GPT2LMHeadModel(scope["config"]).eval()
    model.load_state_dict(scope["model"].state_dict())
    seen: list[torch.Tensor] = []
    model.transformer.h[1].register_forward_hook(
        lambda m, a, o: seen.append((o[0] if isinstance(o, tuple) else o).clone()))
    rows = []
    with torch.no_grad():
        for batch in scope["corpus"](8):
            model(**batch)
            keep = batch["attention_mask"].bool() & (batch["input_ids"] != scope["BOS"])
            rows.append(seen[-1][keep])
    acts = scope["acts"]
    expected = torch.cat(rows) * acts.scale.factors["transformer.h.1"]
    torch.testing.assert_close(acts[list(range(len(acts)))], expected)
    # The stream's rows are the same rows (its own factor, estimated on its first buffer).
    stream = scope["stream"]
    got = stream.scale.undo(torch.cat(list(stream)))
    key = sorted(range(len(got)), key=lambda i: got[i].tolist())
    ref = torch.cat(rows)
    torch.testing.assert_close(got[key], ref[sorted(range(len(ref)),
                                                    key=lambda i: ref[i].tolist())])
