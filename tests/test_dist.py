"""fxprobe under torch.distributed: 2 gloo ranks on CPU, spawned once for the session
(tests/gloo_job.py, shared with the other distributed tests).

Each scenario runs on both ranks inside that job (starting processes is the slow part)
and checks itself against an independent reference: an untapped DDP/FSDP2 run, eager forward
hooks, numpy statistics of every rank's tensors concatenated. The tests below read each
scenario's verdict.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch.distributed as tdist
from dist_scenarios import SCENARIOS
from gloo_job import assert_ok, verdicts
from torch import nn

import fxprobe


@pytest.fixture(scope="module")
def gloo_verdicts(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return verdicts(request.config, "dist_scenarios")


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenario_on_two_gloo_ranks(gloo_verdicts: list[dict[str, Any]], scenario: str) -> None:
    assert_ok(gloo_verdicts, scenario)


def test_needs_an_initialized_process_group() -> None:
    assert not tdist.is_initialized()
    with pytest.raises(fxprobe.ConfigError, match="init_process_group"):
        fxprobe.dist.reduce_stats({})
    with pytest.raises(fxprobe.ConfigError, match="every must be"):
        fxprobe.dist.CrossRankStatsLogger(nn.Linear(1, 1), every=0)
    with pytest.raises(fxprobe.ConfigError, match="sink must be callable"):
        fxprobe.dist.CrossRankStatsLogger(nn.Linear(1, 1), sink="tensorboard")  # type: ignore[arg-type]


if __name__ == "__main__":  # python tests/test_dist.py: the scenarios, verbosely
    sys.exit(pytest.main([__file__, "-v"]))
