"""DPKerasModel and PrivateGradients with the samplers of every scheme: the ledger records each
step's event (epoch starts included), the average divides by the event's denominator, ledgers of
a relation the scheme has no analysis under and datasets the sampler did not draw are refused."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpledger.accountants import make_accountant
from dpledger.adapters.tensorflow import (
    BallsInBinsDatasetSampler,
    DPKerasModel,
    FixedSizeDatasetSampler,
    PoissonDatasetSampler,
    PrivateGradients,
    ShuffleDatasetSampler,
    TruncatedPoissonDatasetSampler,
)
from dpledger.errors import (
    InvalidParameterError,
    SamplerMismatchError,
)
from dpledger.ledger import PrivacyLedger

N = 12
LR = 0.1


def _samplers(seed: int = 5) -> dict:
    return {
        "fixed": FixedSizeDatasetSampler(population_size=N, batch_size=3, seed=seed),
        "truncated": TruncatedPoissonDatasetSampler(
            population_size=N, sampling_probability=0.25, max_batch_size=2, seed=seed
        ),
        "balls": BallsInBinsDatasetSampler(population_size=N, num_batches=3, seed=seed),
        "shuffle": ShuffleDatasetSampler(population_size=N, batch_size=5, seed=seed),
        # drop_last is accepted where b divides n (a no-op there)
        "shuffle_drop": ShuffleDatasetSampler(
            population_size=N, batch_size=4, drop_last=True, seed=seed
        ),
    }


SCHEMES = list(_samplers())


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 3)).astype(np.float32)
    y = rng.normal(size=(N, 1)).astype(np.float32)
    return x, y


def _linear() -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])


def _ledger(sampler) -> PrivacyLedger:
    relation = sampler.sampling_event.relations[0]  # replace_one for fixed size and shuffle
    return PrivacyLedger(neighboring=relation)


def _expected_events(sampler, epochs: int) -> list:
    return [
        sampler.event_for_step(i) for _ in range(epochs) for i in range(sampler.steps_per_epoch)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fit_records_each_steps_event_and_averages_by_its_denominator(scheme):
    # No clipping and no noise: each step is w ← w − lr·Σ_i g_i / D with D the event's
    # denominator (b, q·n, n/k), replayed in float64 on the batches of a twin sampler.
    x, y = _data()
    sampler, twin = _samplers()[scheme], _samplers()[scheme]
    model = _linear()
    w0, b0 = (np.asarray(v, np.float64) for v in model.get_weights())
    dp = DPKerasModel(
        model,
        l2_norm_bound=1e6,
        noise_multiplier=0.0,
        sampler=sampler,
        ledger=_ledger(sampler),
        seed=0,
    )
    dp.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    epochs = 2
    dp.fit(sampler.sample((x, y)), epochs=epochs, verbose=0)
    events = [step.sampling for step in dp.ledger.steps()]
    assert events == _expected_events(sampler, epochs)
    starts = [e.epoch_start for e in events]
    assert starts == [
        sampler.epoch_based and i % sampler.steps_per_epoch == 0 for i in range(len(events))
    ]
    denominator = sampler.sampling_event.average_denominator
    w, b = w0.copy(), b0.copy()
    sizes = []
    for _ in range(epochs):
        for bx, by in twin.sample((x, y)).as_numpy_iterator():
            sizes.append(len(by))
            bx, by = bx.astype(np.float64), by.astype(np.float64)
            residual = bx @ w + b - by  # (B, 1); per-example mse loss (ŷ − y)²
            w = w - LR * (2 * bx.T @ residual) / denominator
            b = b - LR * (2 * residual.sum(axis=0)) / denominator
    assert len(sizes) == len(events)
    if scheme in ("balls", "truncated"):
        assert any(s != denominator for s in sizes)  # the denominator is not the batch size
    if scheme == "shuffle":
        assert sizes[:3] == [5, 5, 2]  # the last, smaller batch is still divided by b
    got_w, got_b = model.get_weights()
    np.testing.assert_allclose(got_w, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_b, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_written_ledger_replays_with_an_accountant_that_supports_the_scheme(scheme, tmp_path):
    x, y = _data()
    sampler = _samplers()[scheme]
    path = tmp_path / "run.ledger"
    relation = sampler.sampling_event.relations[0]
    with PrivacyLedger(path, neighboring=relation) as ledger:
        dp = DPKerasModel(
            _linear(),
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            sampler=sampler,
            ledger=ledger,
            seed=0,
        )
        dp.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
        dp.fit(sampler.sample((x, y)), epochs=1, verbose=0)
    loaded = PrivacyLedger.load(path)
    assert [s.sampling for s in loaded.steps()] == _expected_events(sampler, 1)
    assert all(
        [(q.l2_norm_bound, q.noise_stddev) for q in s.queries] == [(1.0, 1.0)]
        for s in loaded.steps()
    )
    certified_by = "pld" if sampler.sampling_event.scheme.value == "truncated_poisson" else "rdp"
    result = make_accountant(certified_by).epsilon(loaded, delta=1e-5)
    assert math.isfinite(result.epsilon) and result.epsilon > 0


@pytest.mark.parametrize("scheme", ["fixed", "shuffle"])
def test_replace_one_only_schemes_refuse_an_add_remove_ledger_before_recording(scheme):
    sampler = _samplers()[scheme]
    ledger = PrivacyLedger()  # add/remove
    with pytest.raises(InvalidParameterError, match="neighboring='replace_one'"):
        DPKerasModel(
            _linear(), l2_norm_bound=1.0, noise_multiplier=1.0, sampler=sampler, ledger=ledger
        )
    with pytest.raises(InvalidParameterError, match="neighboring='replace_one'"):
        PrivateGradients(
            _linear(),
            keras.losses.MeanSquaredError(reduction="none"),
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            sampler=sampler,
            ledger=ledger,
        )
    assert ledger.num_steps == 0
    # without a ledger, the new one is created with the relation the scheme is analysed under
    dp = DPKerasModel(_linear(), l2_norm_bound=1.0, noise_multiplier=1.0, sampler=sampler)
    assert dp.ledger.neighboring.value == "replace_one"
    assert dp.sampling_event == sampler.sampling_event


def test_fit_refuses_a_users_shuffled_batches_and_names_the_shuffle_sampler():
    x, y = _data()
    sampler = ShuffleDatasetSampler(population_size=N, batch_size=4, seed=0)
    dp = DPKerasModel(
        _linear(), l2_norm_bound=1.0, noise_multiplier=1.0, sampler=sampler, ledger=_ledger(sampler)
    )
    dp.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    users = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).batch(4)
    with pytest.raises(SamplerMismatchError, match="ShuffleDatasetSampler") as info:
        dp.fit(users, epochs=1, verbose=0)
    assert "PoissonDatasetSampler" in str(info.value)
    other = ShuffleDatasetSampler(population_size=N, batch_size=4, seed=0).sample((x, y))
    with pytest.raises(SamplerMismatchError, match="did not draw"):
        dp.fit(other, epochs=1, verbose=0)
    assert dp.ledger.num_steps == 0
    # and with a Poisson sampler too
    poisson = PoissonDatasetSampler(population_size=N, sampling_probability=0.25, seed=0)
    dp = DPKerasModel(_linear(), l2_norm_bound=1.0, noise_multiplier=1.0, sampler=poisson)
    dp.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    with pytest.raises(SamplerMismatchError, match="ShuffleDatasetSampler"):
        dp.fit(users, epochs=1, verbose=0)
    assert dp.ledger.num_steps == 0


def test_epoch_starts_follow_the_iterations_when_fit_keeps_an_iterator_across_epochs():
    # With steps_per_epoch, Keras keeps one iterator across its epochs and makes a new one
    # when it runs out; a fit that stops early abandons its iterator. The epoch starts are
    # where the sampler's iterations start, whatever Keras calls an epoch.
    x, y = _data()
    sampler = ShuffleDatasetSampler(population_size=N, batch_size=4, seed=0)  # 3 batches an epoch
    dp = DPKerasModel(
        _linear(), l2_norm_bound=1.0, noise_multiplier=1.0, sampler=sampler, ledger=_ledger(sampler)
    )
    dp.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    data = sampler.sample((x, y))
    # Keras epochs of 2 steps: iteration A gives steps 0, 1 and 2, runs out, B gives 0, 1, 2
    with pytest.warns(UserWarning, match="ran out of data"):
        dp.fit(data, epochs=4, steps_per_epoch=2, verbose=0)
    starts = [s.sampling.epoch_start for s in dp.ledger.steps()]
    assert starts == [True, False, False, True, False, False]
    # two fits of 2 steps: each takes the first two batches of a new iteration (counting the
    # steps would call the third step the last of an epoch)
    dp.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    dp.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    starts = [s.sampling.epoch_start for s in dp.ledger.steps()][6:]
    assert starts == [True, False, True, False]


@pytest.mark.slow
def test_private_gradients_with_an_epoch_based_sampler():
    x, y = _data()
    sampler = BallsInBinsDatasetSampler(population_size=N, num_batches=3, seed=2)
    private = PrivateGradients(
        _linear(),
        keras.losses.MeanSquaredError(reduction="none"),
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampler=sampler,
        seed=0,
    )
    data = sampler.sample((x, y))
    bx, by = next(iter(data))
    with pytest.raises(InvalidParameterError, match="step_in_epoch"):
        private(bx, by)  # counting steps could merge an unfinished epoch with the next
    assert private.ledger.num_steps == 0
    for _ in range(2):
        for i, (bx, by) in enumerate(data):
            if i == 2 and _ == 0:
                break  # an epoch left unfinished: the next one still starts an epoch
            private(bx, by, step_in_epoch=i)
    starts = [s.sampling.epoch_start for s in private.ledger.steps()]
    assert starts == [True, False, True, False, False]
    # positions that would merge epochs are refused before anything is recorded
    for bad in (3, 1, -1):  # out of range; back to 1 without 0 (after position 2)
        with pytest.raises(InvalidParameterError, match="step_in_epoch"):
            private(bx, by, step_in_epoch=bad)
    assert private.ledger.num_steps == 5
    private(bx, by, step_in_epoch=0)  # a new epoch
    assert (
        private.ledger.num_steps == 6
        and next(reversed(list(private.ledger.steps()))).sampling.epoch_start
    )
    assert private.sampling_event == sampler.sampling_event
