"""CheckConfig: validation of the grids and thresholds of the checks."""

from __future__ import annotations

import pytest

from dpledger.checks import CheckConfig
from dpledger.errors import InvalidParameterError


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"clip_norms": (1.0, 2.0)}, "clip_norms"),
        ({"clip_norms": (1.0, 2.0, -3.0)}, "clip_norms"),
        ({"clip_norms": 5}, "clip_norms"),
        ({"batch_sizes": (1, 2, 2.5)}, "batch_sizes"),
        ({"large_counts": (1, 2, 64)}, "large_counts"),
        ({"count_batch_size": 2}, "count_batch_size"),
        ({"per_example_margin": 0.0}, "per_example_margin"),
        ({"per_example_clip_norm": -1.0}, "per_example_clip_norm"),
        ({"noise_batch_size": 0}, "noise_batch_size"),
        ({"noise_clip_norm_count": 2}, "noise_clip_norm_count"),
        ({"noise_clip_norm_span": 1.0}, "noise_clip_norm_span"),
        ({"seeds_per_clip_norm": 1}, "seeds_per_clip_norm"),
        ({"alpha_slope": 1.0}, "alpha_slope"),
        ({"alpha_magnitude": 0.0}, "alpha_magnitude"),
        ({"flat_rtol": 2.0}, "flat_rtol"),
        ({"elasticity_range": (1.2, 2.0)}, "elasticity_range"),
        ({"elasticity_range": 3}, "elasticity_range"),
        ({"control_tolerance": -0.1}, "control_tolerance"),
    ],
)
def test_config_rejects_bad_values(kwargs, parameter):
    with pytest.raises(InvalidParameterError) as info:
        CheckConfig(**kwargs)
    assert info.value.parameter == parameter


def test_config_sorts_and_deduplicates_grids():
    cfg = CheckConfig(clip_norms=(10, 1, 100, 10), batch_sizes=(8, 1, 4))
    assert cfg.clip_norms == (1.0, 10.0, 100.0)
    assert cfg.batch_sizes == (1, 4, 8)
    assert cfg.counts_batch == 8
