"""Audits of the PyTorch adapter on the digits: the training functions, and the audits themselves.

The audits assert what the issue asks: over several audits with different seeds the lower bound
never exceeds the ε that the runs' ledger claims (PRV, a certified upper bound), the case study's
bug (noise B times too small, same ledger) is refuted, and the white-box audit with a gradient
canary gets within a factor of 2 of the claim.
"""

from __future__ import annotations

import functools
import math
import pickle

import attrs
import numpy as np
import pytest
import torch

from dpledger.accountants import make_accountant
from dpledger.audit import HeldOutSplit, audit_verdict, run_distinguishing_game
from dpledger.audit.threshold_selection import BonferroniThresholds
from dpledger.audit.torch_audit import (
    BlackBoxDigitsAudit,
    UndernoisedDPOptimizer,
    WhiteBoxDigitsAudit,
    digits_records,
    representative_ledger,
    run_black_box_digits,
    run_white_box_digits,
    train_black_box_digits,
    train_white_box_digits,
)
from dpledger.errors import InvalidParameterError, LedgerStateError
from dpledger.ledger.steps import CompressedLedger
from dpledger.mechanisms.clipping import rounding_clip_margin

DELTA = 1e-5
CONFIDENCE = 0.95
NUM_DIGITS = 1797


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@functools.cache
def black_box_config() -> BlackBoxDigitsAudit:
    """q = 0.1, T = 30 on all digits, z calibrated to ε = 1 (RDP) at δ = 1e-5."""
    return BlackBoxDigitsAudit.for_target_epsilon(target_epsilon=1.0, delta=DELTA)


@functools.cache
def white_box_config() -> WhiteBoxDigitsAudit:
    """One full-batch step, z calibrated to ε = 4 (PRV) at δ = 1e-5."""
    return WhiteBoxDigitsAudit.for_target_epsilon(
        target_epsilon=4.0, delta=DELTA, accountant="prv", steps=1
    )


def prv_epsilon(ledger) -> float:
    return make_accountant("prv").epsilon(ledger, delta=DELTA).epsilon


# ------------------------------------------------------------------ data and configurations


def test_digits_records_are_cached_read_only_and_scaled():
    x, y = digits_records()
    assert x.shape == (NUM_DIGITS, 64) and y.shape == (NUM_DIGITS,)
    assert x.min() == 0.0 and x.max() == 1.0
    assert not x.flags.writeable and not y.flags.writeable
    assert digits_records()[0] is x
    x100, y100 = digits_records(100)
    np.testing.assert_array_equal(x100, x[:100])
    np.testing.assert_array_equal(y100, y[:100])
    for bad in (0, 1798, 2.5, True):
        with pytest.raises(InvalidParameterError) as info:
            digits_records(bad)
        assert info.value.parameter == "num_records"


@pytest.mark.parametrize(
    ("cls", "kwargs", "name"),
    [
        (BlackBoxDigitsAudit, {"noise_multiplier": 0.0}, "noise_multiplier"),
        (BlackBoxDigitsAudit, {"noise_multiplier": math.inf}, "noise_multiplier"),
        (
            BlackBoxDigitsAudit,
            {"noise_multiplier": 1, "sampling_probability": 0},
            "sampling_probability",
        ),
        (
            BlackBoxDigitsAudit,
            {"noise_multiplier": 1, "sampling_probability": 1.5},
            "sampling_probability",
        ),
        (BlackBoxDigitsAudit, {"noise_multiplier": 1, "steps": 0}, "steps"),
        (BlackBoxDigitsAudit, {"noise_multiplier": 1, "l2_norm_bound": -1}, "l2_norm_bound"),
        (BlackBoxDigitsAudit, {"noise_multiplier": 1, "learning_rate": 0}, "learning_rate"),
        (BlackBoxDigitsAudit, {"noise_multiplier": 1, "canary_magnitude": 0}, "canary_magnitude"),
        (BlackBoxDigitsAudit, {"noise_multiplier": 1, "canary_label": 10}, "canary_label"),
        (BlackBoxDigitsAudit, {"noise_multiplier": 1, "canary_label": True}, "canary_label"),
        (BlackBoxDigitsAudit, {"noise_multiplier": 1, "num_records": 1798}, "num_records"),
        (BlackBoxDigitsAudit, {"noise_multiplier": 1, "implementation": "buggy"}, "implementation"),
        (BlackBoxDigitsAudit, {"noise_multiplier": 1, "torch_threads": 0}, "torch_threads"),
        (WhiteBoxDigitsAudit, {"noise_multiplier": -1}, "noise_multiplier"),
        (WhiteBoxDigitsAudit, {"noise_multiplier": 1, "steps": 0}, "steps"),
        (WhiteBoxDigitsAudit, {"noise_multiplier": 1, "canary_norm": 0.5}, "canary_norm"),
        (WhiteBoxDigitsAudit, {"noise_multiplier": 1, "canary_label": -1}, "canary_label"),
        (WhiteBoxDigitsAudit, {"noise_multiplier": 1, "implementation": None}, "implementation"),
    ],
)
def test_configurations_reject_bad_input(cls, kwargs, name):
    with pytest.raises(InvalidParameterError) as info:
        cls(**kwargs)
    assert info.value.parameter == name


def test_for_target_epsilon_calibrates_the_claim():
    for config in (black_box_config(), white_box_config()):
        accountant = "rdp" if isinstance(config, BlackBoxDigitsAudit) else "prv"
        target = 1.0 if isinstance(config, BlackBoxDigitsAudit) else 4.0
        eps = make_accountant(accountant).epsilon(config.claimed_ledger(), delta=DELTA).epsilon
        assert target * 0.99 <= eps <= target
    with pytest.raises(InvalidParameterError) as info:
        BlackBoxDigitsAudit.for_target_epsilon(target_epsilon=1.0, delta=DELTA, noise_multiplier=1)
    assert info.value.parameter == "noise_multiplier"
    with pytest.raises(InvalidParameterError) as info:
        WhiteBoxDigitsAudit.for_target_epsilon(target_epsilon=1.0, delta=DELTA, noise_multiplier=1)
    assert info.value.parameter == "noise_multiplier"


def test_white_box_canary_and_preregistered_thresholds():
    config = WhiteBoxDigitsAudit(noise_multiplier=2.0, steps=4, learning_rate=0.5)
    assert config.canary_feature == 0  # pixel 0 is blank in every digit
    np.testing.assert_array_equal(config.canary_input(), np.eye(64)[0] * config.canary_norm)
    canary = config.gradient_canary()
    assert canary.num_parameters == 640 and canary.norm == config.canary_norm
    assert canary.gradient[config.canary_label * 64 + 0] == -config.canary_norm
    assert config.score_unit() == 0.5 * 1.0 / NUM_DIGITS
    assert config.claimed_mu() == 1.0 and config.claimed_score_stddev() == 4.0
    thresholds = config.preregistered_thresholds(count=4, spacing=0.5)
    assert isinstance(thresholds, BonferroniThresholds)
    assert thresholds.thresholds == (2.0, 4.0, 6.0, 8.0)
    with pytest.raises(InvalidParameterError) as info:
        config.preregistered_thresholds(count=0)
    assert info.value.parameter == "count"


# ------------------------------------------------------------------ runs


def test_every_run_records_the_claimed_steps():
    config = attrs.evolve(black_box_config(), steps=3)
    claimed = prv_epsilon(config.claimed_ledger())
    for include in (True, False):
        for implementation in ("correct", "batch_size_bug"):
            run = run_black_box_digits(
                attrs.evolve(config, implementation=implementation), include_canary=include, seed=5
            )
            (steps,) = run.ledger.compressed().runs
            assert steps.count == 3 and steps.sampling_probability == 0.1
            assert steps.noise_multiplier == pytest.approx(config.noise_multiplier, rel=1e-12)
            assert prv_epsilon(run.ledger) == pytest.approx(claimed, rel=1e-9)
            assert run.ledger.population_sizes == (NUM_DIGITS + include,)
    white = attrs.evolve(white_box_config(), steps=2)
    ledger = representative_ledger(white)
    assert ledger.num_steps == 2
    assert prv_epsilon(ledger) == pytest.approx(prv_epsilon(white.claimed_ledger()), rel=1e-9)
    with pytest.raises(InvalidParameterError) as info:
        representative_ledger("config")
    assert info.value.parameter == "config"


def test_a_run_whose_ledger_differs_from_the_claim_is_refused(monkeypatch):
    config = attrs.evolve(black_box_config(), steps=2)
    other = CompressedLedger.from_runs([(0.1, config.noise_multiplier, 3)])
    monkeypatch.setattr(BlackBoxDigitsAudit, "claimed_ledger", lambda self: other)
    with pytest.raises(LedgerStateError, match="every run of an audit must claim the same"):
        run_black_box_digits(config, include_canary=True, seed=0)


def test_runs_are_reproducible_from_their_seed_and_set_one_thread():
    torch.set_num_threads(2)
    config = attrs.evolve(black_box_config(), steps=5)
    a = run_black_box_digits(config, include_canary=True, seed=11).score
    assert torch.get_num_threads() == 1
    assert run_black_box_digits(config, include_canary=True, seed=11).score == a
    assert run_black_box_digits(config, include_canary=True, seed=12).score != a
    train = functools.partial(train_black_box_digits, config=config)
    assert pickle.loads(pickle.dumps(train))(True, 11) == a
    white = functools.partial(train_white_box_digits, config=white_box_config())
    assert pickle.loads(pickle.dumps(white))(False, 3) == white(False, 3)
    for fn, bad in ((run_black_box_digits, white_box_config()), (run_white_box_digits, config)):
        with pytest.raises(InvalidParameterError) as info:
            fn(bad, include_canary=True, seed=0)
        assert info.value.parameter == "config"
    with pytest.raises(InvalidParameterError) as info:
        run_black_box_digits(config, include_canary=True, seed=-1)
    assert info.value.parameter == "seed"


def test_black_box_runs_with_empty_poisson_batches():
    # 20 records at q = 0.05: most batches are empty and are still steps.
    config = BlackBoxDigitsAudit(
        noise_multiplier=1.0, sampling_probability=0.05, steps=10, num_records=20
    )
    run = run_black_box_digits(config, include_canary=False, seed=0)
    assert run.ledger.num_steps == 10 and math.isfinite(run.score)


def test_white_box_canary_moves_its_weight_by_exactly_C_per_step():
    # Noise 1e-12·C: the score counts the steps the canary's clipped gradient was added, in
    # units of η·C/n (the average divides by n + 1 when the canary is in the data). The float32
    # optimizer clips to C·(1 − ρ) with its default rounding margin ρ while the ledger records C.
    # Each of the 3 steps rounds the update and the weight once (2 ulps each).
    config = WhiteBoxDigitsAudit(noise_multiplier=1e-12, steps=3, canary_norm=25.0)
    with_canary = run_white_box_digits(config, include_canary=True, seed=0).score
    without = run_white_box_digits(config, include_canary=False, seed=0).score
    float32_eps = float(np.finfo(np.float32).eps)
    clipped = 1.0 - rounding_clip_margin(float32_eps)
    expected = 3 * clipped * NUM_DIGITS / (NUM_DIGITS + 1)
    assert with_canary == pytest.approx(expected, rel=3 * 2 * float32_eps)
    assert abs(without) < 1e-9  # no digit moves the canary's weight (noise 1e-12 per step)


def test_undernoised_optimizer_records_what_the_correct_one_records():
    config = attrs.evolve(white_box_config(), steps=2)
    correct = run_white_box_digits(config, include_canary=True, seed=4).ledger
    buggy = run_white_box_digits(
        attrs.evolve(config, implementation="batch_size_bug"), include_canary=True, seed=4
    ).ledger
    assert list(buggy.events()) == list(correct.events())
    model = torch.nn.Linear(2, 1)
    optimizer = UndernoisedDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampling_probability=0.5,
        population_size=40,
    )
    assert optimizer.noise_divisor == 20.0
    with pytest.raises(InvalidParameterError) as info:
        UndernoisedDPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            sampling_probability=0.5,
            population_size=40,
            noise_divisor=0.0,
        )
    assert info.value.parameter == "noise_divisor"


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize("implementation", ["correct", "batch_size_bug"])
def test_white_box_score_has_the_noise_scale_the_optimizer_draws(implementation):
    # Without the canary the score is N(0, T·z²) for the correct optimizer and N(0, T·z²/n²)
    # with the bug (q = 1, so B = n). The sample standard deviation of N = 300 runs has standard
    # error σ/√(2(N − 1)); allow 4 of them.
    config = attrs.evolve(white_box_config(), steps=2, implementation=implementation)
    scores = np.array(
        [run_white_box_digits(config, include_canary=False, seed=s).score for s in range(300)]
    )
    want = config.claimed_score_stddev()
    if implementation == "batch_size_bug":
        want /= NUM_DIGITS
    se = want / math.sqrt(2 * (scores.size - 1))
    assert abs(scores.std(ddof=1) - want) < 4 * se
    assert abs(scores.mean()) < 4 * want / math.sqrt(scores.size)


# ------------------------------------------------------------------ the audits


def black_box_audit(config: BlackBoxDigitsAudit, seed: int, runs_per_side: int = 60):
    game = run_distinguishing_game(
        functools.partial(train_black_box_digits, config=config),
        runs_per_side=runs_per_side,
        seed=seed,
        progress=False,
    )
    bound = game.epsilon_lower_bound(
        delta=DELTA, confidence=CONFIDENCE, selection=HeldOutSplit(seed=seed)
    )
    return audit_verdict(bound, representative_ledger(config), accountant="prv")


@pytest.mark.slow
@pytest.mark.statistical
def test_black_box_audit_of_the_adapter_never_exceeds_the_ledgers_epsilon():
    config = black_box_config()
    for seed in (1, 2, 3):
        verdict = black_box_audit(config, seed)
        # The claim is the PRV ε of the ledger every run recorded (ε = 1 by RDP).
        assert verdict.claimed_epsilon == pytest.approx(prv_epsilon(config.claimed_ledger()))
        assert verdict.claimed_epsilon < 1.0
        assert verdict.consistent, str(verdict)
        assert verdict.lower_bound <= verdict.claimed_epsilon


@pytest.mark.slow
@pytest.mark.statistical
def test_black_box_audit_refutes_the_batch_size_bug():
    # The same number of runs as each audit of the correct optimizer above.
    verdict = black_box_audit(attrs.evolve(black_box_config(), implementation="batch_size_bug"), 1)
    assert verdict.refuted, str(verdict)
    assert verdict.status == "claim refuted at confidence 1 − α = 0.95"
    assert verdict.lower_bound > 1.5 * verdict.claimed_epsilon


def white_box_game(config: WhiteBoxDigitsAudit, seed: int, runs_per_side: int):
    return run_distinguishing_game(
        functools.partial(train_white_box_digits, config=config),
        runs_per_side=runs_per_side,
        seed=seed,
        progress=False,
    )


@pytest.mark.slow
@pytest.mark.statistical
def test_white_box_audit_gets_within_a_factor_of_two_and_never_above_the_claim():
    config = white_box_config()
    ledger = representative_ledger(config)
    claim = prv_epsilon(ledger)
    selection = config.preregistered_thresholds()
    for seed in (1, 2):
        game = white_box_game(config, seed, 1000)
        gdp = game.epsilon_lower_bound(
            delta=DELTA, confidence=CONFIDENCE, selection=selection, method="gaussian_dp"
        )
        cp = game.epsilon_lower_bound(delta=DELTA, confidence=CONFIDENCE, selection=selection)
        assert audit_verdict(gdp, ledger, accountant="prv").consistent
        assert audit_verdict(cp, ledger, accountant="prv").consistent
        assert claim / 2 <= gdp.epsilon <= claim
        assert 0 < cp.epsilon < gdp.epsilon  # Gaussian DP is the tighter bound on the same runs


@pytest.mark.slow
@pytest.mark.statistical
def test_white_box_audit_refutes_the_batch_size_bug():
    config = attrs.evolve(white_box_config(), implementation="batch_size_bug")
    game = white_box_game(config, 7, 400)
    bound = game.epsilon_lower_bound(
        delta=DELTA, confidence=CONFIDENCE, selection=config.preregistered_thresholds()
    )
    verdict = audit_verdict(bound, representative_ledger(config), accountant="prv")
    assert verdict.refuted, str(verdict)
    assert bound.counts["fp"] == 0 and bound.counts["fn"] == 0


@pytest.mark.slow
def test_parallel_audit_in_spawned_workers_matches_the_inline_one(tmp_path):
    config = attrs.evolve(black_box_config(), steps=5)
    train = functools.partial(train_black_box_digits, config=config)
    inline = run_distinguishing_game(train, runs_per_side=4, seed=9, progress=False)
    parallel = run_distinguishing_game(
        train,
        runs_per_side=4,
        seed=9,
        workers=2,
        start_method="spawn",
        results_path=tmp_path / "runs.jsonl",
        progress=False,
    )
    np.testing.assert_array_equal(parallel.scores_with_canary, inline.scores_with_canary)
    np.testing.assert_array_equal(parallel.scores_without_canary, inline.scores_without_canary)
    assert "BlackBoxDigitsAudit(" in (tmp_path / "runs.jsonl").read_text().splitlines()[0]
