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

from dpledger.mechanisms.correlated.noise import (
    BandedNoise,
    BltNoise,
    CorrelatedNoise,
    TreeNoise,
    noise_for,
)
from dpledger.mechanisms.correlated.rebuild import strategy_matrix
from dpledger.mechanisms.correlated.release import (
    CorrelatedNoiseRelease,
    count_bands,
    release_event,
)
from dpledger.mechanisms.correlated.sensitivity import SensitivityResult, sensitivity
from dpledger.mechanisms.correlated.spec import CorrelatedNoiseSpec, NoiseStrategy
from dpledger.mechanisms.correlated.strategies import (
    MatrixFactorization,
    banded_toeplitz_factorization,
    blt_factorization,
    blt_prefix_error,
    inverse_toeplitz_coefficients,
    matrix_hash,
    optimize_banded_toeplitz,
    optimize_blt,
    prefix_error,
    prefix_sum_workload,
    tree_factorization,
    tree_nodes,
)
from dpledger.mechanisms.correlated.verification import (
    RecomputedRelease,
    recompute_release,
    verified_release,
)
from dpledger.sampling.participation import (
    ParticipationKind,
    ParticipationSchema,
    count_patterns,
)

__all__ = [
    "BandedNoise",
    "BltNoise",
    "CorrelatedNoise",
    "CorrelatedNoiseRelease",
    "CorrelatedNoiseSpec",
    "MatrixFactorization",
    "NoiseStrategy",
    "ParticipationKind",
    "ParticipationSchema",
    "RecomputedRelease",
    "SensitivityResult",
    "TreeNoise",
    "banded_toeplitz_factorization",
    "blt_factorization",
    "blt_prefix_error",
    "count_bands",
    "count_patterns",
    "inverse_toeplitz_coefficients",
    "matrix_hash",
    "noise_for",
    "optimize_banded_toeplitz",
    "optimize_blt",
    "prefix_error",
    "prefix_sum_workload",
    "recompute_release",
    "release_event",
    "sensitivity",
    "strategy_matrix",
    "tree_factorization",
    "tree_nodes",
    "verified_release",
]
