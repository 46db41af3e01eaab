"""DPConfig.query_arguments and l2_norm_bound_alias: the config's keyword forwarding that the
PyTorch and Keras adapters share."""

from __future__ import annotations

import warnings

import pytest

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms import DPConfig
from dpledger.mechanisms.config import l2_norm_bound_alias


def test_query_arguments_are_the_query_fields_of_the_config() -> None:
    """Reference: the config's own attributes, field by field."""
    config = DPConfig(
        l2_norm_bound=2.0,
        noise_multiplier=1.5,
        clipping="automatic",
        groups="per_layer",
        clip_split="dimension",
        noise_allocation="dimension",
        scales={"w": 2.0},
    )
    arguments = config.query_arguments()
    names = (
        "l2_norm_bound",
        "noise_multiplier",
        "clipping",
        "groups",
        "clip_split",
        "noise_allocation",
        "scales",
    )
    assert set(arguments) == set(names)
    for name in names:
        assert arguments[name] == getattr(config, name)


def test_the_bound_under_its_own_name_is_not_spelled() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert l2_norm_bound_alias(l2_norm_bound=1.0, old="l2_norm_clip", old_value=None) == (
            1.0,
            {},
        )


def test_the_deprecated_name_warns_at_the_callers_line_and_is_spelled() -> None:
    """stacklevel=1 points the warning at the line that called l2_norm_bound_alias."""
    with pytest.warns(DeprecationWarning, match="l2_norm_clip= is deprecated") as record:
        bound, spelled = l2_norm_bound_alias(
            l2_norm_bound=None, old="l2_norm_clip", old_value=3.0, stacklevel=1
        )
    assert (bound, spelled) == (3.0, {"l2_norm_bound": "l2_norm_clip"})
    assert record[0].filename == __file__
    config = DPConfig.resolve(None, spelled=spelled, l2_norm_bound=bound, noise_multiplier=1.0)
    assert config.l2_norm_bound == 3.0


def test_both_names_are_refused() -> None:
    with pytest.raises(InvalidParameterError, match="max_grad_norm"):
        l2_norm_bound_alias(l2_norm_bound=1.0, old="max_grad_norm", old_value=1.0)
