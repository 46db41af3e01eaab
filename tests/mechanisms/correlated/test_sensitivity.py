"""Sensitivity of strategy matrices under participation schemas, against brute force.

Reference: for small T, every contribution vector u ∈ {−1, 0, 1}^T whose support is an allowed
participation pattern is enumerated and max ‖C·u‖ taken (a float64 brute force independent of
the Gram-matrix argument in ``dpledger/mechanisms/correlated/sensitivity.py``). For C with a
non-negative Gram matrix scalar contributions attain the vector maximum (Cauchy–Schwarz), so the
brute force is the exact sensitivity there; where the Gram matrix has negative entries it is a
lower bound of the true value, which the reported upper bound must not undercut.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms.correlated import (
    ParticipationSchema,
    optimize_banded_toeplitz,
    sensitivity,
    tree_factorization,
)
from dpledger.mechanisms.correlated.strategies import (
    banded_toeplitz_factorization,
    blt_factorization,
)
from dpledger.sampling.participation import count_patterns


def allowed(support: tuple[int, ...], schema: ParticipationSchema) -> bool:
    k, b = schema.max_participations, schema.min_separation
    if len(support) > k:
        return False
    if any(j - i < b for i, j in itertools.pairwise(support)):
        return False
    if schema.kind.value == "cyclic":
        return len({i % b for i in support}) <= 1
    return True


def brute_force(c: np.ndarray, schema: ParticipationSchema) -> float:
    t = schema.num_steps
    best = 0.0
    for u in itertools.product((-1.0, 0.0, 1.0), repeat=t):
        support = tuple(i for i in range(t) if u[i] != 0.0)
        if allowed(support, schema):
            best = max(best, float(np.linalg.norm(c @ np.asarray(u))))
    return best


SCHEMAS = [
    ParticipationSchema.single(num_steps=8),
    ParticipationSchema.cyclic(num_steps=8, period=3),
    ParticipationSchema.cyclic(num_steps=8, period=2),
    ParticipationSchema.min_separation_schema(num_steps=8, max_participations=2, min_separation=3),
    ParticipationSchema.min_separation_schema(num_steps=8, max_participations=3, min_separation=2),
    ParticipationSchema.min_separation_schema(num_steps=8, max_participations=4, min_separation=1),
]


def strategies() -> list[tuple[str, np.ndarray]]:
    return [
        ("tree", tree_factorization(8).strategy),
        ("bandmf3", optimize_banded_toeplitz(num_steps=8, bands=3).strategy),
        ("bandmf8", optimize_banded_toeplitz(num_steps=8, bands=8).strategy),
        ("banded_custom", banded_toeplitz_factorization(8, [1.0, 0.9, 0.2]).strategy),
        ("blt", blt_factorization(8, omega=[-0.3, -0.2], theta=[0.6, 0.9]).strategy),
    ]


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: f"{s.kind.value}-k{s.max_participations}")
@pytest.mark.parametrize("name,c", strategies(), ids=lambda x: x if isinstance(x, str) else "")
def test_matches_brute_force_for_non_negative_gram(
    name: str, c: np.ndarray, schema: ParticipationSchema
) -> None:
    """Reference: brute force over all contributions u ∈ {−1,0,1}^8 with allowed support."""
    assert np.all(c.T @ c >= 0.0), name  # every strategy here has a non-negative Gram matrix
    got = sensitivity(c, schema)
    assert got.exact
    assert got.value == pytest.approx(brute_force(c, schema), rel=1e-12)
    assert got.max_column_norm == pytest.approx(float(np.linalg.norm(c, axis=0).max()), rel=1e-12)


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: f"{s.kind.value}-k{s.max_participations}")
def test_negative_gram_gives_an_upper_bound(schema: ParticipationSchema) -> None:
    """Reference: brute force (a lower bound of the vector sensitivity) never exceeds the value,
    which is flagged as not exact when the Gram matrix has a negative entry."""
    c = banded_toeplitz_factorization(8, [1.0, -0.7, 0.4]).strategy
    assert np.any(c.T @ c < 0.0)
    got = sensitivity(c, schema)
    assert got.value >= brute_force(c, schema) - 1e-12
    if schema.max_participations > 1 and schema.min_separation < 3:
        assert not got.exact


def test_upper_bound_beyond_the_pattern_budget_is_sound() -> None:
    """Reference: the exhaustive search (exact for the tree's 0/1 Gram matrix) on the same
    schema; the row-bound dynamic programme used past ``max_patterns`` must not be smaller."""
    c = tree_factorization(16).strategy
    schema = ParticipationSchema.min_separation_schema(
        num_steps=16, max_participations=3, min_separation=4
    )
    exact = sensitivity(c, schema)
    bound = sensitivity(c, schema, max_patterns=1)
    assert exact.exact and not bound.exact
    assert bound.value >= exact.value


@pytest.mark.parametrize("num_steps", list(range(1, 40)))
def test_tree_single_participation_closed_form(num_steps: int) -> None:
    """Reference: TF Privacy's tree-aggregation accounting (``tree_aggregation_accountant``):
    a leaf lies in ⌈log2(T + 1)⌉ complete nodes at most, so sens = √⌈log2(T + 1)⌉ per
    participation."""
    c = tree_factorization(num_steps).strategy
    got = sensitivity(c, ParticipationSchema.single(num_steps=num_steps))
    assert got.value == pytest.approx(math.sqrt(math.ceil(math.log2(num_steps + 1))), rel=1e-15)


def test_banded_min_separation_is_linear_and_exact_for_large_t() -> None:
    """Reference: closed form: with min separation ≥ bands the participating columns are
    orthogonal and every column of a Toeplitz C has norm ≤ ‖c‖, attained by the first k, so
    sens = √k · ‖c‖ (Choquette-Choo et al. 2023, "Amplified Banded Matrix Factorization",
    section 4)."""
    fact = optimize_banded_toeplitz(num_steps=300, bands=5)
    coeffs = np.asarray(fact.params["coefficients"])
    schema = ParticipationSchema.min_separation_schema(
        num_steps=300, max_participations=6, min_separation=50
    )
    got = sensitivity(fact.strategy, schema)
    assert got.exact
    assert got.value == pytest.approx(math.sqrt(6) * float(np.linalg.norm(coeffs)), rel=1e-12)


def test_count_patterns_matches_enumeration() -> None:
    """Reference: the length of the explicit list of maximal patterns."""
    for schema in SCHEMAS:
        assert count_patterns(schema) == len(schema.patterns())


def test_bad_inputs() -> None:
    schema = ParticipationSchema.single(num_steps=4)
    with pytest.raises(InvalidParameterError, match="strategy"):
        sensitivity(np.ones((4, 3)), schema)
    with pytest.raises(InvalidParameterError, match="strategy"):
        sensitivity(np.full((4, 4), np.nan), schema)
    with pytest.raises(InvalidParameterError, match="max_participations"):
        ParticipationSchema(kind="single", num_steps=4, max_participations=2, min_separation=1)
    with pytest.raises(InvalidParameterError, match="max_participations"):
        ParticipationSchema.min_separation_schema(
            num_steps=4, max_participations=3, min_separation=2
        )
    with pytest.raises(InvalidParameterError, match="min_separation"):
        ParticipationSchema.cyclic(num_steps=4, period=5)
    with pytest.raises(InvalidParameterError, match="kind"):
        ParticipationSchema(kind="sometimes", num_steps=4, max_participations=1, min_separation=1)
    with pytest.raises(InvalidParameterError, match="num_steps"):
        ParticipationSchema.single(num_steps=0)


def test_monotone_toeplitz_closed_form_matches_exhaustive_search() -> None:
    """Reference: an exhaustive search over every min-separation pattern of Σ_{i,j∈Π} G_ij (the
    exact value for a non-negative Gram matrix), computed here in the test; the closed form for
    monotone Toeplitz C (McKenna et al. 2024, Theorem 2) must agree on the same C."""
    from dpledger.mechanisms.correlated.sensitivity import _monotone_toeplitz

    coeffs = [math.comb(2 * m, m) / 4**m for m in range(14)]  # 1/sqrt(1 - x): decreasing
    c = banded_toeplitz_factorization(14, coeffs).strategy
    assert _monotone_toeplitz(c)
    for k, b in [(2, 3), (3, 4), (4, 2), (5, 3)]:
        schema = ParticipationSchema.min_separation_schema(
            num_steps=14, max_participations=k, min_separation=b
        )
        closed = sensitivity(c, schema)
        patterns = schema.patterns()
        gram = c.T @ c
        search = max(float(gram[np.ix_(list(p), list(p))].sum()) for p in patterns)
        assert closed.exact
        assert closed.value == pytest.approx(math.sqrt(search), rel=1e-13)


@st.composite
def small_cases(draw: st.DrawFn) -> tuple[np.ndarray, ParticipationSchema]:
    t = draw(st.integers(min_value=1, max_value=6))
    rows = draw(st.integers(min_value=1, max_value=7))
    entries = st.floats(min_value=-2.0, max_value=2.0, allow_nan=False, width=64)
    c = np.array(draw(st.lists(entries, min_size=rows * t, max_size=rows * t))).reshape(rows, t)
    c[0, :] = np.where(np.abs(c[0, :]) < 0.1, 1.0, c[0, :])  # no zero column
    kind = draw(st.sampled_from(["single", "cyclic", "min_separation"]))
    if kind == "single":
        return c, ParticipationSchema.single(num_steps=t)
    b = draw(st.integers(min_value=1, max_value=t))
    if kind == "cyclic":
        return c, ParticipationSchema.cyclic(num_steps=t, period=b)
    k = draw(st.integers(min_value=1, max_value=(t - 1) // b + 1))
    return c, ParticipationSchema.min_separation_schema(
        num_steps=t, max_participations=k, min_separation=b
    )


@settings(max_examples=150, deadline=None)
@given(small_cases())
def test_property_never_below_brute_force_and_exact_when_claimed(
    case: tuple[np.ndarray, ParticipationSchema],
) -> None:
    """Reference: the brute force over u ∈ {−1, 0, 1}^T (a lower bound of the vector
    sensitivity, equal to it for a non-negative Gram matrix and whenever the pattern's columns are
    orthogonal). Every result is at least the brute force; every result flagged exact equals it."""
    c, schema = case
    got = sensitivity(c, schema)
    brute = brute_force(c, schema)
    assert got.value >= brute * (1 - 1e-12) - 1e-12
    if got.exact:
        assert got.value == pytest.approx(brute, rel=1e-9, abs=1e-12)


def _tree_patterns_brute_force(gram: np.ndarray, k: int, b: int) -> float:
    """max over every pattern of 1..k steps with gaps ≥ b of Σ_{i,j∈Π} G_ij, by itertools."""
    t = gram.shape[0]
    best = 0.0
    for size in range(1, k + 1):
        for p in itertools.combinations(range(t), size):
            if all(j - i >= b for i, j in itertools.pairwise(p)):
                best = max(best, float(gram[np.ix_(p, p)].sum()))
    return best


@pytest.mark.parametrize(("t", "k", "b"), [(64, 3, 10), (48, 4, 8), (24, 5, 3), (33, 2, 1)])
def test_tree_min_separation_is_the_exhaustive_maximum(t: int, k: int, b: int) -> None:
    """Reference: every pattern enumerated with itertools (the tree's 0/1 Gram matrix is
    non-negative, so the pattern sum is the exact squared sensitivity). The search is exact:
    equal to it, never below, and at most the row bound it replaces."""
    c = tree_factorization(t).strategy
    schema = ParticipationSchema.min_separation_schema(
        num_steps=t, max_participations=k, min_separation=b
    )
    got = sensitivity(c, schema)
    expected = math.sqrt(_tree_patterns_brute_force(c.T @ c, k, b))
    assert got.exact
    assert got.value == pytest.approx(expected, rel=1e-12)
    assert got.value <= sensitivity(c, schema, max_patterns=1).value


@pytest.mark.parametrize("seed", range(4))
def test_search_matches_itertools_on_signed_gram_matrices(seed: int) -> None:
    """With negative Gram entries the search maximises Σ|G_ij| (the upper bound of the module
    docstring): equal to the itertools maximum of that sum, and never below the brute force of
    the contribution vectors."""
    rng = np.random.default_rng(seed)
    c = rng.normal(size=(9, 9))
    schema = ParticipationSchema.min_separation_schema(
        num_steps=9, max_participations=3, min_separation=2
    )
    got = sensitivity(c, schema)
    assert not got.exact
    expected = math.sqrt(_tree_patterns_brute_force(np.abs(c.T @ c), 3, 2))
    assert got.value == pytest.approx(expected, rel=1e-12)
    assert got.value >= brute_force(c, schema) - 1e-12


@pytest.mark.slow
def test_tree_t256_k4_b50_is_exact_within_the_default_budget() -> None:
    """T = 256, k = 4, b = 50 (6.0·10⁶ patterns, within the default budget): the exact value,
    7.483 = √56, where the row bound gave 11.14. A witness pattern attains √56 (so the value
    is not above the maximum), and the search visits every pattern (so not below it)."""
    c = tree_factorization(256).strategy
    gram = c.T @ c
    schema = ParticipationSchema.min_separation_schema(
        num_steps=256, max_participations=4, min_separation=50
    )
    got = sensitivity(c, schema)
    witness = [0, 63, 127, 191]
    attained = float(gram[np.ix_(witness, witness)].sum())
    assert got.exact
    assert got.value == pytest.approx(math.sqrt(attained), rel=1e-12)
    assert got.value == pytest.approx(math.sqrt(56.0), rel=1e-12)
    assert sensitivity(c, schema, max_patterns=1).value == pytest.approx(11.1355, abs=1e-4)
