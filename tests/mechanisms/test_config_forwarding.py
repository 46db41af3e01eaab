"""DPConfig.query_arguments: the config's keyword forwarding that the PyTorch and Keras adapters
share."""

from __future__ import annotations

from dpledger.mechanisms import DPConfig


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
