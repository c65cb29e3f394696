import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# Tiny models run fastest on one thread, and a shared 2-core machine stays responsive.
torch.set_num_threads(1)


@pytest.fixture
def dynamo_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tracer="auto"`` as if torch dynamo failed on every module fx cannot trace: those
    modules run as written, reached by hooks (the fallback of the fallback)."""
    import fxprobe.frontends.dynamo

    def backend(self: Any, gm: Any, example_inputs: Any) -> Any:
        raise RuntimeError("dynamo fails here (tests/conftest.py)")

    monkeypatch.setattr(fxprobe.frontends.dynamo.DynamoRegion, "backend", backend)
