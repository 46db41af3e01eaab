"""The secure sampler: ChaCha20 against RFC 8439, the discrete Gaussian against its exact pmf,
the grid's sensitivity in the ledger, and the floating-point artefact it removes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpledger import PrivacyLedger
from dpledger.errors import InvalidParameterError
from dpledger.mechanisms.secure_noise import (
    ChaCha20Stream,
    chacha20_blocks,
    discrete_gaussian,
    grid_for,
    secure_noisy_sum,
)

# RFC 8439, section 2.3.2: key 00..1f, nonce 00:00:00:09:00:00:00:4a:00:00:00:00, counter 1.
RFC_KEY = bytes(range(32))
RFC_NONCE = bytes.fromhex("000000090000004a00000000")
RFC_BLOCK = bytes.fromhex(
    "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
    "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e"
)
# RFC 8439, section 2.4.2: the first keystream block (counter 1) of the encryption example.
RFC_ENC_NONCE = bytes.fromhex("000000000000004a00000000")
RFC_PLAINTEXT_START = b"Ladies and Gentlemen of the class of '99: If I could offer you o"
RFC_CIPHERTEXT_START = bytes.fromhex(
    "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
    "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
)


def test_the_block_function_reproduces_rfc_8439():
    (block,) = chacha20_blocks(RFC_KEY, RFC_NONCE, np.array([1]))
    assert block.astype("<u4").tobytes() == RFC_BLOCK
    (block,) = chacha20_blocks(RFC_KEY, RFC_ENC_NONCE, np.array([1]))
    keystream = block.astype("<u4").tobytes()
    assert bytes(p ^ k for p, k in zip(RFC_PLAINTEXT_START, keystream, strict=True)) == (
        RFC_CIPHERTEXT_START
    )


def test_the_stream_is_the_block_function_in_counter_order_and_keyed_from_the_os():
    stream = ChaCha20Stream(key=RFC_KEY, nonce=RFC_NONCE)
    words = np.concatenate([stream.words(5), stream.words(40)])
    blocks = chacha20_blocks(RFC_KEY, RFC_NONCE, np.arange(0, 3)).reshape(-1)
    assert np.array_equal(words[:5], blocks[:5]) and stream.keyed_by_caller
    assert not ChaCha20Stream().keyed_by_caller
    assert not np.array_equal(ChaCha20Stream().words(8), ChaCha20Stream().words(8))
    with pytest.raises(TypeError, match="never pickled"):
        import pickle

        pickle.dumps(stream)
    with pytest.raises(InvalidParameterError, match="key"):
        ChaCha20Stream(key=b"short")


def _exact_pmf(sigma: float, support: np.ndarray) -> np.ndarray:
    """N_Z(0, σ²) by exact normalisation over ±60σ (the rest is below 1e-700)."""
    k = np.arange(-int(60 * sigma) - 1, int(60 * sigma) + 2)
    total = math.fsum(np.exp(-(k.astype(float) ** 2) / (2 * sigma * sigma)))
    return np.exp(-(support.astype(float) ** 2) / (2 * sigma * sigma)) / total


@pytest.mark.parametrize("sigma", [0.7, 2.5, 6.0])
def test_the_discrete_gaussian_matches_its_exact_pmf(sigma):
    """χ² goodness of fit against the exact pmf (bins of expected count ≥ 5 pooled into
    tails), with a key the test fixes: P[reject | exact] = 0.001."""
    draws = discrete_gaussian(ChaCha20Stream(key=bytes([int(10 * sigma)]) * 32), sigma, 200_000)
    edge = int(4 * sigma) + 1
    support = np.arange(-edge, edge + 1)
    pmf = _exact_pmf(sigma, support)
    observed = np.array([np.count_nonzero(draws == k) for k in support], dtype=float)
    tails = 1.0 - pmf.sum()
    observed = np.append(observed, draws.size - observed.sum())
    expected = np.append(pmf, tails) * draws.size
    keep = expected >= 5
    observed = np.append(observed[keep], observed[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    chi2 = float(((observed - expected) ** 2 / np.maximum(expected, 1e-300)).sum())
    assert chi2 < stats.chi2.ppf(0.999, df=keep.sum())


def test_large_sigma_draws_are_gaussian_by_ks():
    sigma = 3.0e5
    draws = discrete_gaussian(ChaCha20Stream(key=bytes(32)), sigma, 50_000)
    # at this scale the lattice is finer than the KS test can see: compare with N(0, σ²)
    result = stats.kstest(draws / sigma, "norm")
    assert result.pvalue > 0.001
    assert draws.dtype == np.int64


def test_the_ledger_records_the_sensitivity_after_rounding():
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=0.1, population_size=100)
    x = np.linspace(-1, 1, 1000)
    out = secure_noisy_sum(
        x, ledger=ledger, l2_norm_bound=1.0, noise_stddev=2.0, stream=ChaCha20Stream()
    )
    gamma = grid_for(l2_norm_bound=1.0, dim=1000)
    assert gamma == 2.0 ** math.floor(math.log2(1e-3 / math.sqrt(1000)))
    (query,) = [e for e in ledger.events() if hasattr(e, "noise_stddev")]
    assert query.l2_norm_bound == 1.0 + gamma * math.sqrt(1000) <= 1.001
    assert query.noise_stddev == 2.0
    steps = out / gamma
    assert np.array_equal(steps, np.rint(steps))  # every output is on the grid, exactly
    with pytest.raises(InvalidParameterError, match="grid"):
        secure_noisy_sum(
            x, ledger=ledger, l2_norm_bound=1.0, noise_stddev=2.0, stream=ChaCha20Stream(),
            grid=0.3,
        )  # fmt: skip


def test_secure_outputs_are_exact_grid_multiples_whatever_the_input():
    """What closes the floating-point channel: the released value is (round(x/γ) + K)·γ,
    exactly, for inputs of any magnitude (0, 1 and 1 + 2⁻⁵², whose float spacings differ), so
    its low bits carry nothing about x beyond round(x/γ)."""
    gamma = 2.0**-30
    ledger = PrivacyLedger()
    for x in (0.0, 1.0, 1.0 + 2.0**-52, -3.0e3):
        ledger.record_sample(sampling_probability=1.0, scheme="full")
        out = secure_noisy_sum(
            np.full(1000, x), ledger=ledger, l2_norm_bound=1.0, noise_stddev=2.0**-20,
            stream=ChaCha20Stream(), grid=gamma,
        )  # fmt: skip
        steps = out / gamma
        assert np.array_equal(steps, np.rint(steps))
        # and the noise is the discrete Gaussian's: the output minus the rounded input
        k = steps - np.rint(x / gamma)
        assert abs(float(np.std(k)) / 2.0**10 - 1.0) < 5 / math.sqrt(2 * 1000)


def test_the_numpy_mechanisms_record_the_grids_sensitivity_with_the_secure_backend():
    from dpledger.ledger.provenance import provenance_of
    from dpledger.mechanisms import GaussianSumQuery, GroupedSumQuery, sampled_step
    from dpledger.mechanisms.secure_noise import SecureNoiseBackend
    from dpledger.mechanisms.sum_query import ScaledGaussianSumQuery

    backend = SecureNoiseBackend(grid=2.0**-20)
    ledger = PrivacyLedger()
    group = GroupedSumQuery(
        [
            GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=0.5, label="a"),
            GaussianSumQuery(l2_norm_bound=2.0, noise_stddev=1.0, label="b"),
        ]
    )
    with sampled_step(ledger, sampling_probability=0.5, backend=backend) as step:
        (a,), (b,) = step.run(group, [[np.ones((3, 7))], [np.ones((3, 2, 5))]])
    bounds = [e.l2_norm_bound for e in ledger.events() if hasattr(e, "noise_stddev")]
    assert bounds == [1.0 + 2.0**-20 * math.sqrt(7), 2.0 + 2.0**-20 * math.sqrt(10)]
    for out in (a, b):
        assert np.array_equal(out * 2.0**20, np.rint(out * 2.0**20))
    (record,) = provenance_of(ledger.notes)
    assert record.secure_sampler and record.seeding == "os_entropy"
    assert record.generator.startswith("chacha20")
    scaled = ScaledGaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0, scales=(1.0, 2.0))
    with (
        sampled_step(ledger, sampling_probability=0.5, backend=backend) as step,
        pytest.raises(InvalidParameterError, match="scales"),
    ):
        step.run(scaled, [np.ones((2, 3)), np.ones((2, 3))])
    with pytest.raises(InvalidParameterError, match="grid"):
        SecureNoiseBackend(grid=0.3)


def test_dpconfig_secure_noise_is_a_checked_bool():
    from dpledger.mechanisms import DPConfig

    assert DPConfig(l2_norm_bound=1.0, noise_multiplier=1.0).secure_noise is False
    assert DPConfig(l2_norm_bound=1.0, noise_multiplier=1.0, secure_noise=True).secure_noise
    with pytest.raises(InvalidParameterError, match="secure_noise"):
        DPConfig(l2_norm_bound=1.0, noise_multiplier=1.0, secure_noise="yes")
