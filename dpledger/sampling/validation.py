"""The checks of the sampling parameters, shared by every sampler of every framework.

Each function returns the value converted to its canonical Python type, or raises
:class:`~dpledger.errors.InvalidParameterError` naming the parameter, the value given and the
valid values. The PyTorch and TensorFlow samplers and the optimizers call these, so that one
scheme refuses the same arguments with the same message whatever the framework.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dpledger.errors import InvalidParameterError
from dpledger.validation import (
    check_bool,
    check_positive_finite,
    check_positive_int,
    check_probability,
)

__all__ = [
    "MAX_POPULATION",
    "check_drop_last",
    "check_expected_batch_size",
    "check_population_size",
    "check_sampling_probability",
    "check_size_within_population",
    "check_step_position",
    "check_steps",
    "default_steps",
]

MAX_POPULATION = 1 << 33
"""The largest population the NumPy :class:`~dpledger.sampling.PoissonSampler` draws from (one
uniform draw per record)."""


def check_population_size(value: Any, *, maximum: int | None = None) -> int:
    """n, the number of records (or users) sampled from: an integer ≥ 1 (≤ ``maximum``, a power
    of two, if given).

    Raises:
        InvalidParameterError: naming ``population_size``.
    """
    n = check_positive_int("population_size", value)
    if maximum is not None and n > maximum:
        raise InvalidParameterError(
            "population_size",
            value,
            f"an integer in [1, 2**{maximum.bit_length() - 1} = {maximum}]: drawing one uniform "
            "number per record takes about a minute beyond that",
        )
    return n


def check_sampling_probability(
    value: Any, *, allow_zero: bool = False, name: str = "sampling_probability"
) -> float:
    """q, the probability that a record (or user) is in a batch: in (0, 1], or [0, 1] when
    ``allow_zero``.

    Raises:
        InvalidParameterError: naming ``name``.
    """
    q = check_probability(name, value)
    if q == 0.0 and not allow_zero:
        raise InvalidParameterError(name, value, "a probability in (0, 1] (q = 0 never samples)")
    return q


def check_size_within_population(
    name: str, value: Any, *, population_size: int, what: str = "an integer"
) -> int:
    """A batch size, a cap or a number of batches: an integer in [1, n].

    Args:
        name: the parameter's name (``batch_size``, ``max_batch_size``, ``num_batches``).
        value: the value given.
        population_size: n, already checked.
        what: how the message calls a valid value ("a batch size", …).

    Raises:
        InvalidParameterError: naming ``name`` and n.
    """
    size = check_positive_int(name, value)
    if size > population_size:
        raise InvalidParameterError(
            name, value, f"{what} in [1, population_size={population_size}]"
        )
    return size


def check_expected_batch_size(value: Any, *, population_size: int) -> float:
    """q·n, the mean size of a Poisson batch: a number in (0, n] (q = value / n).

    Raises:
        InvalidParameterError: naming ``expected_batch_size``.
    """
    size = check_positive_finite("expected_batch_size", value)
    if size > population_size:
        raise InvalidParameterError(
            "expected_batch_size", value, f"a number in (0, {population_size}]"
        )
    return size


def default_steps(batches_per_epoch: float, *, round_half_up: bool = False) -> int:
    """The default number of batches of one pass over a sampler: ``batches_per_epoch`` rounded
    to an integer ≥ 1 (1/q batches see n records in expectation; n/b batches of b records).

    Args:
        batches_per_epoch: 1/q or n/b.
        round_half_up: round halves up (the ``tf.data`` samplers) rather than to even (Python's
            ``round``, the PyTorch samplers).
    """
    if round_half_up:
        return max(1, math.floor(batches_per_epoch + 0.5))
    return max(1, round(batches_per_epoch))


def check_steps(name: str, value: Any, *, default: int) -> int:
    """The batches of one pass over a sampler: ``default`` for None, else an integer ≥ 1.

    Raises:
        InvalidParameterError: naming ``name`` (``steps`` or ``steps_per_epoch``).
    """
    if value is None:
        value = default
    return check_positive_int(name, value)


def check_drop_last(value: Any, *, batch_size: int, population_size: int) -> bool:
    """Whether a shuffled epoch leaves out its last, smaller batch: only allowed when b divides
    n, where it changes nothing.

    Leaving the remainder out of every epoch is not the ``shuffle(b, n)`` the ledger records.

    Raises:
        InvalidParameterError: naming ``drop_last``: not a bool, or True with b not dividing n.
    """
    if check_bool("drop_last", value) and population_size % batch_size:
        raise InvalidParameterError(
            "drop_last",
            value,
            f"False when batch_size={batch_size} does not divide population_size="
            f"{population_size}: leaving the last {population_size % batch_size} records of "
            "every epoch out is not the shuffle(b, n) the ledger records (keep the smaller last "
            "batch)",
        )
    return value


def check_step_position(value: Any, *, steps_per_epoch: int) -> int:
    """The 0-based position of a batch in one pass over a sampler: an integer in
    [0, steps_per_epoch).

    Raises:
        InvalidParameterError: naming ``step``.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or not 0 <= value < steps_per_epoch
    ):
        raise InvalidParameterError(
            "step", value, f"an integer in [0, steps_per_epoch={steps_per_epoch})"
        )
    return int(value)
