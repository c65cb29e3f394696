import gc
import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# Tiny models run fastest on one thread, and a shared 2-core machine stays responsive.
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "tv_jobs(*jobs): scripts the test runs in the "
                            "torchvision venv (tests/tv_venv.py), batched for the session")


def pytest_collection_finish(session: pytest.Session) -> None:
    import gloo_job
    import tv_venv

    tv_venv.start_batch(session.config, session.items)
    gloo_job.collected(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    import tv_venv

    tv_venv.finish_batch(session.config)


@pytest.fixture
def dynamo_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tracer="auto"`` as if torch dynamo failed on every module fx cannot trace: those
    modules run as written, reached by hooks (the fallback of the fallback)."""
    import fxprobe.frontends.dynamo

    def backend(self: Any, gm: Any, example_inputs: Any) -> Any:
        raise RuntimeError("dynamo fails here (tests/conftest.py)")

    monkeypatch.setattr(fxprobe.frontends.dynamo.DynamoRegion, "backend", backend)


@pytest.fixture
def young_gc() -> Any:
    """``gc.collect()`` in the test scans only the objects made since it began: those of the
    tests before it in the worker (thousands of graphs in a whole run) cannot reach what the
    test made, and scanning them made a test with a few collections take most of a minute."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
