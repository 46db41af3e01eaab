"""DPKerasModel(noise=spec): correlated-noise training with the release recorded once.

References, each named in its test:

* the core float64 generator (``noise_for``) built independently with the same seed: with a
  loss linear in the weights the gradient does not depend on them, so the difference of the
  weights of a run with noise and a run with σ = 0 (same batches) is exactly
  −lr/denominator · Σ_t w_t (float64 model, rounding only);
* the μ-GDP closed form (Dong, Roth & Su 2019, Corollary 2.13) with μ = Δ·S/σ, Δ the largest
  ‖C·u‖ over the cyclic patterns u (brute force over the ``period`` offsets with NumPy);
* dp-accounting's RDP accountant on k Poisson-subsampled Gaussians of noise multiplier
  σ/(S·max_j ‖C_j‖) (Choquette-Choo et al. 2023, "Amplified Banded Matrix Factorization",
  section 4) and dp-accounting's PLD accountant on ``PrivacyLedger.to_dp_event()``.
"""

from __future__ import annotations

import math
from typing import Any

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

from dpledger import PrivacyLedger
from dpledger.accountants.base import make_accountant
from dpledger.adapters.tensorflow import (
    CyclicDatasetSampler,
    DPKerasModel,
    PoissonDatasetSampler,
    PrivateGradients,
)
from dpledger.adapters.tensorflow.correlated_step import CorrelatedDatasetStream
from dpledger.errors import (
    InvalidParameterError,
    LedgerNotAttachedError,
    LedgerStateError,
    NoiseStreamEndError,
    SamplerMismatchError,
)
from dpledger.ledger.correlated import (
    NoiseSeedReuseError,
    NoiseStreamRollbackError,
    StreamStepEvent,
)
from dpledger.mechanisms.correlated import CorrelatedNoiseSpec, noise_for
from dpledger.mechanisms.sum_query import SensitivityCheckError
from tests.gdp_oracle import gaussian_epsilon

N, PERIOD, T, SEED, S, Z, LR = 40, 4, 8, 11, 1.0, 2.0, 0.5
DELTA = 1e-5

SPECS = {
    "tree_honaker": CorrelatedNoiseSpec(strategy="tree_honaker", num_steps=T, period=PERIOD),
    "bandmf_amplified": CorrelatedNoiseSpec(
        strategy="bandmf",
        num_steps=T,
        period=PERIOD,
        bands=2,
        amplified=True,
        sampling_probability=0.5,
    ),
    "blt": CorrelatedNoiseSpec(strategy="blt", num_steps=T, period=PERIOD, buffers=2),
}


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 5)), rng.integers(0, 3, N).astype(np.int32)


def _sampler(spec: CorrelatedNoiseSpec, seed: int = 5) -> CyclicDatasetSampler:
    return CyclicDatasetSampler(
        population_size=N,
        period=spec.period,
        num_steps=spec.num_steps,
        sampling_probability=spec.sampling_probability if spec.amplified else None,
        seed=seed,
    )


def _linear_model(dtype: str = "float64") -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((5,), dtype=dtype), keras.layers.Dense(3, dtype=dtype)])


def _linear_loss(y: tf.Tensor, p: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(p, axis=-1)  # gradient (x ⊗ 1, 1): independent of the weights


def _train(spec: CorrelatedNoiseSpec, z: float, ledger: PrivacyLedger, epochs: int = 2) -> Any:
    x, y = _data()
    model = _linear_model()
    dp = DPKerasModel(
        model,
        l2_norm_bound=S,
        noise_multiplier=z,
        sampler=_sampler(spec),
        ledger=ledger,
        seed=SEED,
        noise=spec,
    )
    dp.compile(optimizer=keras.optimizers.SGD(LR), loss=_linear_loss)
    dp.fit(x, y, epochs=epochs, verbose=0)
    return dp, np.concatenate([np.asarray(v).ravel() for v in model.trainable_variables])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SPECS))
def test_each_step_adds_the_core_streams_noise_and_the_release_is_recorded_once(name, tmp_path):
    """Reference: the core generator ``noise_for(C, d, σ = z·S, seed)`` built here: the weights
    of the noised run minus those of the σ = 0 run are −lr/denominator · Σ_t w_t."""
    spec = SPECS[name]
    path = tmp_path / "run.ledger"
    ledger = PrivacyLedger(path)
    dp, noised = _train(spec, Z, ledger)
    _, plain = _train(spec, 0.0, PrivacyLedger())
    generator = noise_for(spec.factorization(), dim=noised.size, noise_stddev=Z * S, seed=SEED)
    total = np.sum([generator.next() for _ in range(T)], axis=0)
    denominator = N / PERIOD * (spec.sampling_probability if spec.amplified else 1.0)
    expected = -LR / denominator * total
    np.testing.assert_allclose(noised - plain, expected, rtol=0, atol=1e-11 * np.abs(total).max())
    ledger.close()
    loaded = PrivacyLedger.load(path)
    (event,) = loaded.correlated_releases
    assert loaded.num_steps == 0  # the stream's steps record no sampling or sum-query events
    assert loaded.stream_progress(0) == T  # but each records its stream step, after the release
    assert list(loaded.events()) == [event, *(StreamStepEvent(0, t) for t in range(T))]
    assert (event.l2_norm_bound, event.noise_stddev, event.num_steps) == (S, Z * S, T)
    assert (event.participation, event.min_separation, event.max_participations) == (
        "cyclic",
        PERIOD,
        T // PERIOD,
    )
    assert event.strategy_hash == spec.factorization().strategy_hash
    assert event.sampling_probability == (spec.sampling_probability if spec.amplified else 1.0)
    assert dp._dp_stream.step == T


def _cyclic_mu(spec: CorrelatedNoiseSpec) -> tuple[float, float]:
    """Brute force with NumPy: Δ = max over the period offsets of ‖Σ_{t in pattern} C_t‖ and
    the largest column norm of C."""
    c = np.asarray(spec.factorization().strategy, dtype=np.float64)
    sens = max(np.linalg.norm(c[:, list(range(i, T, PERIOD))].sum(axis=1)) for i in range(PERIOD))
    return float(sens), float(np.linalg.norm(c, axis=0).max())


@pytest.mark.parametrize("name", ["tree_honaker", "blt"])
def test_epsilon_of_an_unamplified_run_is_the_closed_form_of_its_mu(name, tmp_path):
    """Reference: the μ-GDP closed form with μ = Δ·S/σ (Δ by brute force over the cyclic
    patterns); PLD and GDP exact for one Gaussian, PRV within its bounds, RDP a looser bound."""
    spec = SPECS[name]
    path = tmp_path / "run.ledger"
    ledger = PrivacyLedger(path)
    _train(spec, Z, ledger)
    ledger.close()
    loaded = PrivacyLedger.load(path)
    sens, _ = _cyclic_mu(spec)
    mu = sens * S / (Z * S)
    assert loaded.correlated_releases[0].gaussian_mu == pytest.approx(mu, rel=1e-12)
    exact = gaussian_epsilon(mu, DELTA)
    for accountant in ("pld", "gdp", "prv", "rdp"):
        result = make_accountant(accountant).epsilon(loaded, delta=DELTA)
        assert math.isfinite(result.value)
        if accountant in ("pld", "gdp"):
            assert result.value == pytest.approx(exact, rel=1e-9)
        elif accountant == "prv":
            assert result.lower - 1e-9 <= exact <= result.upper + 1e-9
        else:
            assert result.value >= exact


@pytest.mark.slow
def test_epsilon_of_an_amplified_bandmf_run(tmp_path):
    """References: dp-accounting's RDP accountant on k = T/period compositions of
    PoissonSampled(q, Gaussian(σ/(S·max_j ‖C_j‖))) and its PLD accountant on the ledger's
    dp-accounting event (within one grid step per composition); PRV finite."""
    spec = SPECS["bandmf_amplified"]
    path = tmp_path / "run.ledger"
    ledger = PrivacyLedger(path)
    _train(spec, Z, ledger)
    ledger.close()
    loaded = PrivacyLedger.load(path)
    _, column = _cyclic_mu(spec)
    k, q = T // PERIOD, spec.sampling_probability
    oracle = dp_accounting.rdp.RdpAccountant()
    oracle.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(Z / column)), k
        )
    )
    rdp = make_accountant("rdp").epsilon(loaded, delta=DELTA)
    assert rdp.value == pytest.approx(oracle.get_epsilon(DELTA), rel=1e-6)
    pld_oracle = dp_accounting.pld.PLDAccountant()
    pld_oracle.compose(loaded.to_dp_event())
    pld = make_accountant("pld").epsilon(loaded, delta=DELTA)
    assert pld.value == pytest.approx(pld_oracle.get_epsilon(DELTA), abs=1e-4 * k)
    assert math.isfinite(make_accountant("prv").epsilon(loaded, delta=DELTA).value)


def _model_for(spec: CorrelatedNoiseSpec, ledger: PrivacyLedger, **kwargs: Any) -> DPKerasModel:
    dp = DPKerasModel(
        _linear_model(),
        l2_norm_bound=S,
        noise_multiplier=Z,
        sampler=kwargs.pop("sampler", None) or _sampler(spec),
        ledger=ledger,
        seed=SEED,
        noise=spec,
        **kwargs,
    )
    dp.compile(optimizer=keras.optimizers.SGD(LR), loss=_linear_loss)
    return dp


def test_batches_the_sampler_did_not_draw_are_refused_before_anything_is_recorded():
    spec = SPECS["tree_honaker"]
    x, y = _data()
    ledger = PrivacyLedger()
    dp = _model_for(spec, ledger)
    other = _sampler(spec)  # same parameters, another object: not the model's draws
    foreign = [
        tf.data.Dataset.from_tensor_slices((x, y)).batch(10),
        other.sample((x, y)),
        dp._dp_sampler.sample((x, y)).shuffle(4),
    ]
    for data in foreign:
        with pytest.raises(SamplerMismatchError, match="did not draw"):
            dp.fit(data, epochs=1, verbose=0)
    with pytest.raises(InvalidParameterError, match="batch_size"):
        dp.fit(x, y, batch_size=10, verbose=0)
    with pytest.raises(SamplerMismatchError, match="train_on_batch"):
        dp.train_on_batch(x[:10], y[:10])  # position 0 of step 0, but not the sampler's batch
    assert ledger.correlated_releases == () and ledger.num_steps == 0
    dp.fit(dp._dp_sampler.sample((x, y)).prefetch(2), epochs=1, verbose=0)
    assert len(ledger.correlated_releases) == 1


def test_step_t_plus_one_is_refused_with_a_typed_error():
    spec = SPECS["tree_honaker"]
    x, y = _data()
    ledger = PrivacyLedger()
    dp = _model_for(spec, ledger)
    with pytest.raises(NoiseStreamEndError, match="3 epochs"):
        dp.fit(x, y, epochs=3, verbose=0)  # 12 steps of an 8-step release: refused up front
    assert ledger.correlated_releases == ()
    dp.fit(x, y, epochs=2, verbose=0)
    before = [np.asarray(v).copy() for v in dp.model.trainable_variables]
    with pytest.raises(NoiseStreamEndError, match="num_steps=8"):
        dp.fit(x, y, epochs=1, verbose=0)
    after = [np.asarray(v) for v in dp.model.trainable_variables]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert len(ledger.correlated_releases) == 1
    stream = dp._dp_stream
    with pytest.raises(NoiseStreamEndError):  # the host stage refuses it too
        stream.step_noise(ledger, num_records=1, position=0, norm=0.0, eps=1e-16)


def test_sensitivity_check_runs_before_the_release_is_recorded():
    """A clipped sum longer than |R|·S is refused and nothing is recorded or drawn."""
    spec = SPECS["tree_honaker"]
    ledger = PrivacyLedger()
    sampler = _sampler(spec)
    stream = CorrelatedDatasetStream(
        spec, sampler, l2_norm_bound=S, noise_multiplier=Z, dim=3, seed=0
    )
    with pytest.raises(SensitivityCheckError):
        stream.step_noise(ledger, num_records=2, position=0, norm=2.5 * S, eps=1e-16)
    assert ledger.correlated_releases == () and stream.step == 0
    with pytest.raises(SamplerMismatchError):  # a batch at another position than step 0's
        stream.step_noise(ledger, num_records=2, position=1, norm=0.0, eps=1e-16)
    stream.step_noise(ledger, num_records=2, position=0, norm=2.0 * S, eps=1e-16)
    assert len(ledger.correlated_releases) == 1 and stream.step == 1


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        (
            {"sampler": PoissonDatasetSampler(population_size=N, sampling_probability=0.1)},
            "sampler",
        ),
        ({"groups": "per_parameter"}, "groups"),
        ({"generator": tf.random.Generator.from_seed(0), "seed": None}, "generator"),
        ({"bias_callback": lambda step, metrics: None}, "bias_callback"),
    ],
)
def test_bad_set_ups_are_refused(kwargs, parameter):
    spec = SPECS["tree_honaker"]
    base = {
        "l2_norm_bound": S,
        "noise_multiplier": Z,
        "sampler": _sampler(spec),
        "seed": SEED,
        "noise": spec,
    }
    with pytest.raises(InvalidParameterError, match=parameter):
        DPKerasModel(_linear_model(), **{**base, **kwargs})


def test_a_sampler_of_another_spec_and_an_unknown_noise_are_refused():
    spec = SPECS["tree_honaker"]
    wrong = CyclicDatasetSampler(population_size=N, period=2, num_steps=T, seed=0)
    with pytest.raises(InvalidParameterError, match="sampler"):
        DPKerasModel(
            _linear_model(), l2_norm_bound=S, noise_multiplier=Z, sampler=wrong, noise=spec
        )
    with pytest.raises(InvalidParameterError, match="noise"):
        DPKerasModel(
            _linear_model(), l2_norm_bound=S, noise_multiplier=Z, sampler=wrong, noise="tree"
        )
    dp = _model_for(spec, PrivacyLedger())
    with pytest.raises(InvalidParameterError, match="noise"):
        dp.update_queries(noise_multiplier=1.0)


def _keras_model_for(spec, ledger, sampler=None):  # type: ignore[no-untyped-def]
    keras.utils.set_random_seed(2)
    inner = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    dp = DPKerasModel(
        inner,
        l2_norm_bound=S,
        noise_multiplier=Z,
        sampler=sampler or _sampler(spec),
        ledger=ledger,
        seed=SEED,
        noise=spec,
    )
    dp.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return dp


@pytest.mark.slow
def test_save_and_load_continue_the_stream_without_recording_it_again(tmp_path):
    """Reference: an uninterrupted run of the same spec, seeds and batches."""
    spec = SPECS["bandmf_amplified"]
    x, y = _data()
    x = x.astype(np.float32)
    whole = _keras_model_for(spec, PrivacyLedger())
    whole.fit(x, y, epochs=2, verbose=0)
    path = tmp_path / "run.ledger"
    ledger = PrivacyLedger(path)
    first = _keras_model_for(spec, ledger)
    first.fit(x, y, epochs=1, verbose=0)
    first.save(tmp_path / "model.keras")
    ledger.close()
    loaded = keras.models.load_model(tmp_path / "model.keras")
    with pytest.raises(LedgerNotAttachedError):
        loaded.fit(x, y, epochs=1, verbose=0)
    with pytest.raises(InvalidParameterError, match="holds this model's correlated-noise"):
        loaded.attach_ledger(PrivacyLedger())  # a ledger without the release
    with pytest.raises(InvalidParameterError, match="sampler"):
        loaded.attach_ledger(PrivacyLedger(path, resume=True), sampler=_sampler(spec, seed=6))
    loaded.attach_ledger(PrivacyLedger(path, resume=True))
    loaded.fit(x, y, epochs=1, verbose=0)
    loaded.ledger.close()
    got = np.concatenate([np.asarray(v).ravel() for v in loaded.model.trainable_variables])
    want = np.concatenate([np.asarray(v).ravel() for v in whole.model.trainable_variables])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    back = PrivacyLedger.load(path)
    assert back.correlated_releases == whole.ledger.correlated_releases  # recorded once
    with pytest.raises(NoiseStreamEndError):
        loaded.fit(x, y, epochs=1, verbose=0)


def _weights(dp: Any) -> np.ndarray:
    return np.concatenate([np.asarray(v).ravel() for v in dp.model.trainable_variables])


@pytest.mark.slow
def test_a_seedless_run_saved_and_loaded_continues_the_uninterrupted_run(tmp_path):
    """Reference: the same seedless run continued without interruption (same tolerance as the
    save-and-load test above). With seed=None for the sampler and the model, the save keeps the
    seeds drawn (the partition's and the noise's), so the loaded model continues the run's own
    batches and noise on a copy of the ledger as it was at the save."""
    spec = SPECS["bandmf_amplified"]
    x, y = _data()
    x = x.astype(np.float32)
    sampler = CyclicDatasetSampler(
        population_size=N,
        period=spec.period,
        num_steps=spec.num_steps,
        sampling_probability=spec.sampling_probability,
    )
    keras.utils.set_random_seed(2)
    dp = DPKerasModel(
        keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)]),
        l2_norm_bound=S,
        noise_multiplier=Z,
        sampler=sampler,
        ledger=PrivacyLedger(tmp_path / "a.ledger"),
        noise=spec,
    )
    dp.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    dp.fit(x, y, epochs=1, verbose=0)
    dp.save(tmp_path / "model.keras")
    dp.ledger.flush()
    (tmp_path / "b.ledger").write_bytes((tmp_path / "a.ledger").read_bytes())
    dp.fit(x, y, epochs=1, verbose=0)
    dp.ledger.close()
    loaded = keras.models.load_model(tmp_path / "model.keras")
    loaded.attach_ledger(PrivacyLedger(tmp_path / "b.ledger", resume=True))
    loaded.fit(x, y, epochs=1, verbose=0)
    loaded.ledger.close()
    np.testing.assert_allclose(_weights(loaded), _weights(dp), rtol=1e-6, atol=1e-7)
    a, b = PrivacyLedger.load(tmp_path / "a.ledger"), PrivacyLedger.load(tmp_path / "b.ledger")
    assert a.correlated_releases == b.correlated_releases
    assert a.stream_progress(0) == b.stream_progress(0) == spec.num_steps


@pytest.mark.slow
def test_an_older_save_is_refused_and_the_latest_continues(tmp_path):
    """Reference: an uninterrupted run of the same spec, seeds and batches (same tolerance as
    the save-and-load test above), and the ledger's progress: a save at p = 4 attached to the
    ledger after it recorded q = 8 steps would reuse w_4..w_7, so it is refused before anything
    is recorded; the save at 8 continues."""
    spec = CorrelatedNoiseSpec(strategy="tree_honaker", num_steps=12, period=PERIOD)
    x, y = _data()
    x = x.astype(np.float32)
    whole = _keras_model_for(spec, PrivacyLedger())
    whole.fit(x, y, epochs=3, verbose=0)
    path = tmp_path / "run.ledger"
    first = _keras_model_for(spec, PrivacyLedger(path))
    first.fit(x, y, epochs=1, verbose=0)
    first.save(tmp_path / "old.keras")
    first.fit(x, y, epochs=1, verbose=0)
    first.save(tmp_path / "latest.keras")
    first.ledger.close()
    ledger = PrivacyLedger(path, resume=True)
    events = list(ledger.events())
    assert ledger.stream_progress(0) == 8
    old = keras.models.load_model(tmp_path / "old.keras")
    with pytest.raises(NoiseStreamRollbackError, match=r"steps 4\.\.7 .* step 8") as info:
        old.attach_ledger(ledger)
    assert (info.value.checkpoint_step, info.value.ledger_step) == (4, 8)
    assert list(ledger.events()) == events
    with pytest.raises(LedgerNotAttachedError):
        old.fit(x, y, epochs=1, verbose=0)
    latest = keras.models.load_model(tmp_path / "latest.keras")
    latest.attach_ledger(ledger)
    latest.fit(x, y, epochs=1, verbose=0)
    ledger.close()
    np.testing.assert_allclose(_weights(latest), _weights(whole), rtol=1e-6, atol=1e-7)
    back = PrivacyLedger.load(path)
    assert back.stream_progress(0) == 12 and len(back.correlated_releases) == 1


def test_a_ledger_behind_the_save_is_refused(tmp_path):
    """A ledger holding the release but fewer of its steps than the save took is not the run's
    ledger."""
    spec = SPECS["tree_honaker"]
    x, y = _data()
    first = _keras_model_for(spec, PrivacyLedger())
    first.fit(x.astype(np.float32), y, epochs=1, verbose=0)
    first.save(tmp_path / "model.keras")
    other = PrivacyLedger()
    other.record_correlated_release(first.ledger.correlated_releases[0])
    other.record_stream_step(release=0, step=0)
    loaded = keras.models.load_model(tmp_path / "model.keras")
    with pytest.raises(LedgerStateError, match="records only 1 steps") as info:
        loaded.attach_ledger(other)
    assert not isinstance(info.value, NoiseStreamRollbackError)


def test_sampling_properties_of_a_correlated_model():
    """The cyclic sampler's n and the release's q; no per-step sampling event."""
    amplified = _keras_model_for(SPECS["bandmf_amplified"], PrivacyLedger())
    assert amplified.sampling_probability == 0.5 and amplified.population_size == N
    whole_groups = _keras_model_for(SPECS["tree_honaker"], PrivacyLedger())
    assert whole_groups.sampling_probability == 1.0 and whole_groups.population_size == N
    with pytest.raises(InvalidParameterError, match="correlated-noise release"):
        whole_groups.sampling_event  # noqa: B018
    private, _ = _private(SPECS["tree_honaker"], Z, PrivacyLedger())
    with pytest.raises(InvalidParameterError, match="correlated-noise release"):
        private.sampling_event  # noqa: B018


def _private(spec: CorrelatedNoiseSpec, z: float, ledger: PrivacyLedger) -> Any:
    model = _linear_model()
    sampler = _sampler(spec)
    private = PrivateGradients(
        model,
        _linear_loss,
        l2_norm_bound=S,
        noise_multiplier=z,
        sampler=sampler,
        ledger=ledger,
        seed=SEED,
        noise=spec,
    )
    return private, sampler


@pytest.mark.slow
def test_private_gradients_add_the_core_streams_noise_step_by_step():
    """Reference: the core generator ``noise_for(C, d, σ = z·S, seed)`` built here: each call's
    gradient minus the σ = 0 call's on the same batch is w_t / denominator."""
    spec = SPECS["bandmf_amplified"]
    x, y = _data()
    ledger = PrivacyLedger()
    noised, sampler = _private(spec, Z, ledger)
    plain, plain_sampler = _private(spec, 0.0, PrivacyLedger())
    generator = noise_for(spec.factorization(), dim=18, noise_stddev=Z * S, seed=SEED)
    denominator = N / PERIOD * spec.sampling_probability
    with pytest.raises(InvalidParameterError, match="step_in_epoch"):
        noised(x[:3], y[:3])
    for _ in range(T // PERIOD):
        batches = zip(sampler.sample((x, y)), plain_sampler.sample((x, y)), strict=True)
        for i, ((xb, yb), (xp, yp)) in enumerate(batches):
            np.testing.assert_array_equal(xb.numpy(), xp.numpy())
            got = np.concatenate(
                [
                    np.ravel(a - b)
                    for a, b in zip(
                        noised(xb, yb, step_in_epoch=i), plain(xp, yp, step_in_epoch=i), strict=True
                    )
                ]
            )
            w = generator.next() / denominator
            np.testing.assert_allclose(got, w, rtol=0, atol=1e-12 * np.abs(w).max())
    assert len(ledger.correlated_releases) == 1 and ledger.num_steps == 0
    with pytest.raises(NoiseStreamEndError):
        noised(x[:3], y[:3], step_in_epoch=0)


def test_private_gradients_refuse_a_batch_at_another_position():
    spec = SPECS["tree_honaker"]
    x, y = _data()
    ledger = PrivacyLedger()
    private, _ = _private(spec, Z, ledger)
    with pytest.raises(SamplerMismatchError, match="stream's step 0"):
        private(x[:3], y[:3], step_in_epoch=1)
    assert ledger.correlated_releases == ()


@pytest.mark.slow
def test_a_second_release_with_a_given_seed_is_refused_before_anything_is_recorded():
    """Two releases of one ledger with the same seed would add the same noise to different
    gradients; the ledger records no seeds, so a ledger that holds a release takes another
    only from a freshly drawn seed (seed=None)."""
    spec = SPECS["tree_honaker"]
    x, y = _data()
    ledger = PrivacyLedger()
    _train(spec, Z, ledger, epochs=1)
    events = list(ledger.events())
    again = _model_for(spec, ledger)  # seed=SEED again
    with pytest.raises(NoiseSeedReuseError, match="seed=None"):
        again.fit(again._dp_sampler.sample((x, y)), epochs=1, verbose=0)
    assert list(ledger.events()) == events  # nothing recorded
    fresh = DPKerasModel(
        _linear_model(),
        l2_norm_bound=S,
        noise_multiplier=Z,
        sampler=_sampler(spec),
        ledger=ledger,
        noise=spec,
    )  # seed=None: drawn afresh
    fresh.compile(optimizer=keras.optimizers.SGD(LR), loss=_linear_loss)
    fresh.fit(fresh._dp_sampler.sample((x, y)), epochs=1, verbose=0)
    assert len(ledger.correlated_releases) == 2 and ledger.stream_progress(1) == PERIOD


def test_a_pass_started_before_the_previous_one_ended_is_refused():
    """A batch drawn for a stream step the model already released repeats that step's Poisson
    draw (the same records, not a fresh Bernoulli(q) draw); the position check alone cannot
    see it, so the sampler notes such draws and the next step is refused, nothing recorded."""
    spec = SPECS["bandmf_amplified"]
    ledger = PrivacyLedger()
    sampler = _sampler(spec)
    stream = CorrelatedDatasetStream(
        spec, sampler, l2_norm_bound=S, noise_multiplier=Z, dim=3, seed=0
    )
    first = iter(sampler.index_dataset())
    for j in range(PERIOD - 1):
        next(first)
        stream.step_noise(ledger, num_records=1, position=j, norm=0.0, eps=1e-16)
    next(first)  # the batch of the pass's last step, drawn before its release
    assert sampler.take_stale_draws() == []
    early = iter(sampler.index_dataset())
    next(early)  # a second pass, started at the same first step, draws step 0 again
    events = list(ledger.events())
    # tf.data may prefetch the pass's next draws too: steps 0, 1, … (all released ones)
    with pytest.raises(SamplerMismatchError, match=r"drew stream steps \[0(, [12])*\] again"):
        stream.step_noise(ledger, num_records=1, position=PERIOD - 1, norm=0.0, eps=1e-16)
    assert list(ledger.events()) == events and stream.step == PERIOD - 1
    list(early)  # the stale pass drawn to its end (its prefetch done), its draws noted
    assert set(sampler.take_stale_draws()) <= {1, 2}
    stream.step_noise(ledger, num_records=1, position=PERIOD - 1, norm=0.0, eps=1e-16)
    assert ledger.stream_progress(0) == PERIOD
