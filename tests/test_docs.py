"""The Python examples in the user docs run as written."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ["docs/modes.md", "docs/extractor.md", "docs/artifacts.md", "README.md"]


def _blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("doc", DOCS)
def test_python_examples_run(doc: str, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = _blocks(ROOT / doc)
    assert blocks, f"{doc} has no python example"
    scope: dict[str, object] = {"__name__": "__docs__"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{doc}[{i}]", "exec"), scope)
        except Exception as e:  # name the block that failed
            raise AssertionError(f"{doc} example {i} failed: {e!r}\n{code}") from e


def test_every_public_name_is_in_the_api_reference() -> None:
    import fxprobe

    api = (ROOT / "docs/api.md").read_text()
    missing = [n for n in fxprobe.__all__ if f"### `{n}" not in api]
    assert not missing, f"docs/api.md lacks {missing}"
