"""Correlated-noise (matrix-factorization) mechanisms: tree aggregation, BandMF, BLT.

Framework-neutral (NumPy/SciPy, float64). See ``docs/correlated-noise.md``: the strategies
(:mod:`.strategies`), their streaming noise generators (:mod:`.noise`), the participation schemas
(:mod:`.participation`), what a training run asks for (:mod:`.spec`) and the sensitivity of a
strategy under a schema (:mod:`.sensitivity`), and the check that a recorded release's
sensitivity is what its parameters give (:mod:`.verification`).

Example:
    >>> from dpledger.mechanisms.correlated import (
    ...     ParticipationSchema, noise_for, optimize_banded_toeplitz, sensitivity)
    >>> import math
    >>> fact = optimize_banded_toeplitz(num_steps=64, bands=4)   # BandMF, 4 bands
    >>> schema = ParticipationSchema.cyclic(num_steps=64, period=16)   # 4 epochs
    >>> sens = sensitivity(fact.strategy, schema)   # = √4 · ‖c‖: the 4 columns are orthogonal
    >>> math.isclose(sens.value, 2 * math.hypot(*fact.params["coefficients"])), sens.exact
    (True, True)
    >>> gen = noise_for(fact, dim=10, noise_stddev=1.0, seed=0)
    >>> gen.next().shape
    (10,)
"""

from dpledger.mechanisms.correlated.noise import noise_for
from dpledger.mechanisms.correlated.release import CorrelatedNoiseRelease
from dpledger.mechanisms.correlated.sensitivity import SensitivityResult, sensitivity
from dpledger.mechanisms.correlated.spec import CorrelatedNoiseSpec
from dpledger.mechanisms.correlated.strategies import (
    optimize_banded_toeplitz,
    optimize_blt,
    tree_factorization,
)
from dpledger.sampling.participation import ParticipationSchema

__all__ = [
    "CorrelatedNoiseRelease",
    "CorrelatedNoiseSpec",
    "ParticipationSchema",
    "SensitivityResult",
    "noise_for",
    "optimize_banded_toeplitz",
    "optimize_blt",
    "sensitivity",
    "tree_factorization",
]
