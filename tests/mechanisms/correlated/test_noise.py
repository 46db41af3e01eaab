"""Streaming noise generators: exactness, checkpoints, memory.

Reference: the explicit matrix mechanism. With the same seed, the i.i.d. noise Z is the same
draws (row by row from ``numpy.random.default_rng(seed)``), and the streamed per-step noise must
equal C⁻¹·Z (square C, by ``numpy.linalg.solve``) or, for the tree, have prefix sums B·Z.
"""

from __future__ import annotations

import numpy as np
import pytest

from dpledger.errors import InvalidParameterError, LedgerStateError
from dpledger.mechanisms.correlated import noise_for, optimize_banded_toeplitz, tree_factorization
from dpledger.mechanisms.correlated.noise import BandedNoise
from dpledger.mechanisms.correlated.strategies import blt_factorization


def stream(gen, steps: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.stack([gen.next() for _ in range(steps)])


@pytest.mark.parametrize("num_steps", [1, 6, 16, 23])
@pytest.mark.parametrize("honaker", [False, True])
def test_tree_noise_prefix_sums_equal_b_z(num_steps: int, honaker: bool) -> None:
    """Reference: B·Z from the explicit tree factorization."""
    f = tree_factorization(num_steps, honaker=honaker)
    w = stream(noise_for(f, dim=4, noise_stddev=0.7, seed=3), num_steps)
    z = np.random.default_rng(3).standard_normal((f.strategy.shape[0], 4)) * 0.7
    np.testing.assert_allclose(np.cumsum(w, axis=0), f.decoder @ z, atol=1e-12)


def test_banded_and_blt_noise_equal_c_inverse_z() -> None:
    """Reference: numpy.linalg.solve(C, Z)."""
    for f in (
        optimize_banded_toeplitz(num_steps=40, bands=5),
        blt_factorization(40, omega=[-0.35, -0.1], theta=[0.5, 0.95]),
    ):
        w = stream(noise_for(f, dim=3, noise_stddev=2.0, seed=11), 40)
        z = np.random.default_rng(11).standard_normal((40, 3)) * 2.0
        np.testing.assert_allclose(w, np.linalg.solve(f.strategy, z), atol=1e-12)


@pytest.mark.parametrize(
    "fact",
    [
        tree_factorization(20, honaker=True),
        tree_factorization(20),
        optimize_banded_toeplitz(num_steps=20, bands=4),
        blt_factorization(20, omega=[-0.3], theta=[0.7]),
    ],
    ids=["honaker", "tree", "banded", "blt"],
)
def test_state_dict_resumes_the_stream_exactly(fact) -> None:  # type: ignore[no-untyped-def]
    """Reference: an uninterrupted stream with the same seed."""
    full = stream(noise_for(fact, dim=5, noise_stddev=1.0, seed=7), 20)
    first = noise_for(fact, dim=5, noise_stddev=1.0, seed=7)
    head = stream(first, 9)
    state = first.state_dict()
    first.next()  # advancing the original does not change the saved state
    second = noise_for(fact, dim=5, noise_stddev=1.0, seed=999)
    second.load_state_dict(state)
    tail = stream(second, 11)
    np.testing.assert_array_equal(np.concatenate([head, tail]), full)


@pytest.mark.parametrize(
    "fact",
    [
        tree_factorization(20, honaker=True),
        tree_factorization(20),
        optimize_banded_toeplitz(num_steps=20, bands=4),
        blt_factorization(20, omega=[-0.3], theta=[0.7]),
    ],
    ids=["honaker", "tree", "banded", "blt"],
)
def test_a_state_of_another_dimension_is_refused(fact) -> None:  # type: ignore[no-untyped-def]
    """The buffers of a d = 5 stream cannot continue a d = 4 one, and the refused state changes
    nothing: the generator goes on with the stream of an untouched one (its reference)."""
    other = noise_for(fact, dim=5, noise_stddev=1.0, seed=3)
    stream(other, 3)
    gen = noise_for(fact, dim=4, noise_stddev=1.0, seed=7)
    head = stream(gen, 2)
    with pytest.raises(InvalidParameterError, match=r"state\['buffers'\]"):
        gen.load_state_dict(other.state_dict())
    assert gen.step == 2
    full = stream(noise_for(fact, dim=4, noise_stddev=1.0, seed=7), 20)
    np.testing.assert_array_equal(np.concatenate([head, stream(gen, 18)]), full)


@pytest.mark.parametrize("bands", [1, 2, 5, 9])
def test_banded_memory_is_b_minus_one_vectors(bands: int) -> None:
    """Reference: the count of buffered floats is (b − 1)·d, independent of T (O(b·d))."""
    d = 1000
    for t in (50, 400):
        gen = noise_for(
            optimize_banded_toeplitz(num_steps=t, bands=bands), dim=d, noise_stddev=1.0, seed=0
        )
        for _ in range(t // 2):
            gen.next()
        assert gen.buffer_floats() == (bands - 1) * d


def test_tree_and_blt_memory() -> None:
    """Reference: one vector per tree level (⌊log2 T⌋ + 1, plus the running prefix) and one
    per BLT buffer."""
    d, t = 100, 64
    gen = noise_for(tree_factorization(t), dim=d, noise_stddev=1.0, seed=0)
    stream(gen, t)
    assert gen.buffer_floats() <= (t.bit_length() + 1) * d
    blt = noise_for(
        blt_factorization(t, omega=[-0.3, -0.1, -0.05], theta=[0.2, 0.6, 0.9]),
        dim=d,
        noise_stddev=1.0,
        seed=0,
    )
    stream(blt, t)
    assert blt.buffer_floats() == 3 * d


def test_stream_refuses_steps_beyond_t_and_bad_inputs() -> None:
    f = optimize_banded_toeplitz(num_steps=3, bands=2)
    gen = noise_for(f, dim=2, noise_stddev=1.0, seed=0)
    stream(gen, 3)
    with pytest.raises(LedgerStateError, match="num_steps=3"):
        gen.next()
    with pytest.raises(InvalidParameterError, match="noise_stddev"):
        noise_for(f, dim=2, noise_stddev=-1.0, seed=0)
    with pytest.raises(InvalidParameterError, match="dim"):
        noise_for(f, dim=0, noise_stddev=1.0, seed=0)
    with pytest.raises(InvalidParameterError, match="factorization"):
        BandedNoise(f, bands=1, dim=2, noise_stddev=1.0, seed=0)  # C has 2 bands
    with pytest.raises(InvalidParameterError, match="state"):
        gen.load_state_dict(
            {"rng": gen.state_dict()["rng"], "step": 1, "buffers": {"ring": np.zeros((5, 2))}}
        )
    with pytest.raises(InvalidParameterError, match="state"):
        gen.load_state_dict({})
