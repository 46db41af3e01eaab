"""Batch samplers of every sampling scheme: their draws, their events, checkpoints, and DP steps.

Statistical tests use fixed seeds and tolerances of about 4 standard errors of the statistic
(or a p-value above 1e-3 for a χ² statistic), derived from the statistic's exact distribution
under the scheme.
"""

from __future__ import annotations

import math

import pytest
import scipy.stats
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.data import (
    DataLoader,
    RandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from dpledger import PrivacyLedger
from dpledger.accountants import make_accountant
from dpledger.adapters.torch import (
    BallsInBinsBatchSampler,
    DPOptimizer,
    FixedSizeBatchSampler,
    PoissonBatchSampler,
    ShuffleBatchSampler,
    TruncatedPoissonBatchSampler,
    make_private,
    private_data_loader,
)
from dpledger.adapters.torch.sampler_base import RecordedBatchSampler
from dpledger.errors import InvalidParameterError, SamplerMismatchError
from dpledger.ledger import SamplingEvent, SamplingScheme
from tests.adapters.torch.reference import DEVICES


def _claim_all(sampler: RecordedBatchSampler, batches: list[list[int]]) -> list[SamplingEvent]:
    return [sampler.claim_draw(len(b)) for b in batches]


def _two_sided_chi2(statistic: float, df: int) -> None:
    assert scipy.stats.chi2.sf(statistic, df=df) > 1e-3
    assert scipy.stats.chi2.cdf(statistic, df=df) > 1e-3


# ---------------------------------------------------------------------------- distributions
@pytest.mark.statistical
def test_fixed_size_batches_are_uniform_subsets_of_exactly_b():
    n, b, steps = 50, 10, 3000
    sampler = FixedSizeBatchSampler(population_size=n, batch_size=b, steps=steps, seed=11)
    counts = torch.zeros(n, dtype=torch.float64)
    for batch in sampler:
        assert len(batch) == b and batch == sorted(set(batch)) and 0 <= batch[0] < n
        counts[batch] += 1
    p = b / n
    # a record's count is Binomial(steps, b/n); the counts sum to steps·b, so the Pearson
    # statistic (mean n) is (n/(n-1))·χ²(n-1) approximately
    pearson = ((counts - steps * p) ** 2 / (steps * p * (1 - p))).sum().item()
    _two_sided_chi2(pearson * (n - 1) / n, n - 1)
    # without replacement: P(two given records both in) = b(b-1)/(n(n-1)), not (b/n)²
    n, b, steps = 10, 5, 20000
    small = FixedSizeBatchSampler(population_size=n, batch_size=b, steps=steps, seed=12)
    both = sum((0 in batch) and (1 in batch) for batch in small)
    pair = b * (b - 1) / (n * (n - 1))
    se = math.sqrt(pair * (1 - pair) / steps)
    assert abs(both / steps - pair) < 4 * se
    assert abs(pair - (b / n) ** 2) > 8 * se  # far from what independent draws would give


@pytest.mark.statistical
def test_truncated_poisson_sizes_never_exceed_the_cap_and_follow_min_binomial():
    n, q, cap, steps = 100, 0.2, 18, 3000
    sampler = TruncatedPoissonBatchSampler(
        population_size=n, sampling_probability=q, max_batch_size=cap, steps=steps, seed=5
    )
    sizes, counts = [], torch.zeros(n, dtype=torch.float64)
    for batch in sampler:
        assert len(batch) <= cap and batch == sorted(set(batch))
        sizes.append(len(batch))
        counts[batch] += 1
    binom = scipy.stats.binom(n, q)
    support = range(cap + 1)
    pmf = [binom.pmf(k) for k in range(cap)] + [binom.sf(cap - 1)]  # P(min(X, cap) = k)
    mean = sum(k * w for k, w in zip(support, pmf, strict=True))
    var = sum(k * k * w for k, w in zip(support, pmf, strict=True)) - mean**2
    sizes_t = torch.tensor(sizes, dtype=torch.float64)
    assert abs(sizes_t.mean().item() - mean) < 4 * math.sqrt(var / steps)
    capped = (sizes_t == cap).double().mean().item()
    assert abs(capped - pmf[-1]) < 4 * math.sqrt(pmf[-1] * (1 - pmf[-1]) / steps)
    # by symmetry every record is in a batch with probability E[min(X, cap)] / n
    p = mean / n
    z = (counts - steps * p) / math.sqrt(steps * p * (1 - p))
    assert z.abs().max().item() < 4.5  # 100 records: P(any |Z| > 4.5) ≈ 7e-4


@pytest.mark.statistical
def test_balls_in_bins_puts_every_record_in_one_uniform_bin_per_epoch():
    n, k, epochs = 60, 6, 1500
    sampler = BallsInBinsBatchSampler(population_size=n, num_batches=k, seed=3)
    assert len(sampler) == k
    sizes, bin_of_0 = [], torch.zeros(k)
    together = 0
    for _ in range(epochs):
        batches = list(sampler)
        assert len(batches) == k
        assert sorted(i for b in batches for i in b) == list(range(n))  # each record once
        assert all(b == sorted(b) for b in batches)
        sizes.extend(len(b) for b in batches)
        home = next(j for j, b in enumerate(batches) if 0 in b)
        bin_of_0[home] += 1
        together += 1 in batches[home]
    p = 1 / k
    sizes_t = torch.tensor(sizes, dtype=torch.float64)
    # a batch's size is Binomial(n, 1/k); the k sizes of an epoch sum to n, so their mean is
    # exactly n/k, and the sample variance's standard error is taken over epochs rather than
    # batches (a wider, conservative tolerance for the correlated sizes of an epoch)
    assert abs(sizes_t.mean().item() - n * p) < 1e-12
    var = n * p * (1 - p)
    assert abs(sizes_t.var().item() - var) < 4 * var * math.sqrt(2 / (epochs - 1))
    expected = epochs * p
    _two_sided_chi2(((bin_of_0 - expected) ** 2 / expected).sum().item(), k - 1)
    # two records land in the same bin with probability 1/k (independent assignment)
    assert abs(together / epochs - p) < 4 * math.sqrt(p * (1 - p) / epochs)


@pytest.mark.statistical
def test_shuffle_epochs_are_permutations_cut_into_batches_of_b():
    n, b, epochs = 23, 5, 2000
    sampler = ShuffleBatchSampler(population_size=n, batch_size=b, seed=8)
    assert len(sampler) == 5
    position = torch.zeros(n)
    for _ in range(epochs):
        batches = list(sampler)
        assert [len(x) for x in batches] == [5, 5, 5, 5, 3]
        flat = [i for x in batches for i in x]
        assert sorted(flat) == list(range(n))
        position[flat.index(0)] += 1
    expected = epochs / n
    _two_sided_chi2(((position - expected) ** 2 / expected).sum().item(), n - 1)
    # leaving the remainder out is not the recorded shuffle(b, n): refused; a no-op otherwise
    with pytest.raises(InvalidParameterError, match="does not divide"):
        ShuffleBatchSampler(population_size=n, batch_size=b, drop_last=True, seed=8)
    exact = ShuffleBatchSampler(population_size=20, batch_size=b, drop_last=True, seed=8)
    assert [len(x) for x in exact] == [5] * 4


# ---------------------------------------------------------------------------- events
def test_every_sampler_claims_draws_with_its_event():
    cases = [
        (PoissonBatchSampler(population_size=20, sampling_probability=0.25, seed=0),
         SamplingEvent.poisson(0.25, 20)),
        (FixedSizeBatchSampler(population_size=20, batch_size=4, seed=0),
         SamplingEvent.fixed_size(4, 20)),
        (TruncatedPoissonBatchSampler(
            population_size=20, sampling_probability=0.25, max_batch_size=3, seed=0),
         SamplingEvent.truncated_poisson(0.25, 20, 3)),
    ]  # fmt: skip
    for (sampler, event), steps in zip(cases, [4, 5, 4], strict=True):  # round(1/q), round(n/b)
        assert sampler.sampling_event() == event
        assert sampler.denominator == event.average_denominator
        batches = list(sampler)
        assert len(batches) == len(sampler) == steps == sampler.unclaimed_draws
        assert _claim_all(sampler, batches) == [event] * steps
        with pytest.raises(SamplerMismatchError, match="drew no batch"):
            sampler.claim_draw(2)
    assert FixedSizeBatchSampler(population_size=20, batch_size=4).denominator == 4.0


@pytest.mark.parametrize("kind", ["balls_in_bins", "shuffle"])
def test_epoch_start_marks_the_first_recorded_step_of_each_epoch(kind):
    if kind == "shuffle":
        sampler = ShuffleBatchSampler(population_size=10, batch_size=3, seed=0)
        event = SamplingEvent.shuffle
        args = (3, 10)
    else:
        sampler = BallsInBinsBatchSampler(population_size=10, num_batches=4, seed=0)
        event = SamplingEvent.balls_in_bins
        args = (4, 10)
    assert sampler.denominator == (3.0 if kind == "shuffle" else 2.5)
    first = list(sampler)
    assert _claim_all(sampler, first) == [event(*args, epoch_start=True)] + [event(*args)] * 3
    # the first batch of an epoch skipped: the mark moves to the next recorded step
    second = list(sampler)
    sampler.discard_draw()
    assert _claim_all(sampler, second[1:]) == [event(*args, epoch_start=True)] + [event(*args)] * 2
    # a refused step is not recorded either: the mark stays for the next claim
    third = list(sampler)
    with pytest.raises(SamplerMismatchError, match="drew a batch of"):
        sampler.claim_draw(len(third[0]) + 1)
    assert sampler.claim_draw(len(third[1])) == event(*args, epoch_start=True)
    # an abandoned pass: the next pass is a new epoch
    fourth = iter(sampler)
    sampler.claim_draw(len(next(fourth)))
    fifth = list(sampler)
    assert sampler.unclaimed_draws == 4
    assert sampler.claim_draw(len(fifth[0])) == event(*args, epoch_start=True)


def test_a_batch_of_another_size_is_refused():
    sampler = FixedSizeBatchSampler(population_size=10, batch_size=3, seed=0)
    next(iter(sampler))
    with pytest.raises(SamplerMismatchError, match="drew a batch of 3"):
        sampler.claim_draw(2)
    assert sampler.unclaimed_draws == 0


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("make", [
    lambda seed: FixedSizeBatchSampler(population_size=30, batch_size=7, seed=seed),
    lambda seed: TruncatedPoissonBatchSampler(
        population_size=30, sampling_probability=0.3, max_batch_size=6, seed=seed),
])  # fmt: skip
def test_per_step_samplers_resume_the_same_stream(make):
    a = make(1)
    list(a)
    state = a.state_dict(include_generator_state=True)  # the bit-for-bit opt-in
    rest = [list(a) for _ in range(2)]
    b = make(2)
    b.load_state_dict(state)
    assert [list(b) for _ in range(2)] == rest


@pytest.mark.parametrize("kind", ["balls_in_bins", "shuffle"])
@pytest.mark.parametrize("done", [0, 2, 4])
def test_epoch_samplers_resume_the_same_epoch_and_the_next(kind, done):
    def make(seed):
        if kind == "shuffle":
            return ShuffleBatchSampler(population_size=17, batch_size=4, seed=seed)  # 5 batches
        return BallsInBinsBatchSampler(population_size=17, num_batches=5, seed=seed)

    a = make(1)
    list(a)  # a whole first epoch, prefetched and never claimed
    it = iter(a)
    epoch = [next(it) for _ in range(min(done + 2, 5))]  # drawn ahead of the steps
    claimed = _claim_all(a, epoch[:done])
    assert (claimed[:1] == [a.sampling_event(epoch_start=True)]) == (done > 0)
    state = a.state_dict(include_generator_state=True)  # the bit-for-bit opt-in
    tail = epoch[done:] + list(it)
    next_epoch = list(a)

    b = make(2)
    b.load_state_dict(state)
    resumed = list(b)
    assert resumed == tail
    events = _claim_all(b, resumed)
    # the resumed epoch's start was recorded before the checkpoint (when done > 0)
    assert events[0].epoch_start is (done == 0)
    assert not any(e.epoch_start for e in events[1:])
    assert list(b) == next_epoch
    # reseeding (a run resumed after steps the checkpoint does not hold) starts a new epoch
    b.reseed(3)
    fresh = list(b)
    assert b.claim_draw(len(fresh[0])).epoch_start


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("make", "parameter"),
    [
        (lambda: FixedSizeBatchSampler(population_size=5, batch_size=6), "batch_size"),
        (lambda: FixedSizeBatchSampler(population_size=5, batch_size=0), "batch_size"),
        (lambda: FixedSizeBatchSampler(population_size=0, batch_size=1), "population_size"),
        (lambda: FixedSizeBatchSampler(population_size=5, batch_size=2, steps=0), "steps"),
        (
            lambda: TruncatedPoissonBatchSampler(
                population_size=5, sampling_probability=0.0, max_batch_size=2
            ),
            "sampling_probability",
        ),
        (
            lambda: TruncatedPoissonBatchSampler(
                population_size=5, sampling_probability=0.5, max_batch_size=0
            ),
            "max_batch_size",
        ),
        (lambda: BallsInBinsBatchSampler(population_size=5, num_batches=6), "num_batches"),
        (lambda: BallsInBinsBatchSampler(population_size=5, num_batches=1.5), "num_batches"),
        (lambda: ShuffleBatchSampler(population_size=5, batch_size=9), "batch_size"),
        (lambda: ShuffleBatchSampler(population_size=5, batch_size=2, drop_last=1), "drop_last"),
        (lambda: ShuffleBatchSampler(population_size=5, batch_size=2, seed="x"), "seed"),
        (
            lambda: ShuffleBatchSampler(
                population_size=5, batch_size=2, seed=1, generator=torch.Generator()
            ),
            "seed",
        ),
        (lambda: ShuffleBatchSampler(population_size=5, batch_size=2, generator=3), "generator"),
    ],
)
def test_bad_arguments_are_refused_with_the_parameter_named(make, parameter):
    with pytest.raises(InvalidParameterError) as info:
        make()
    assert info.value.parameter == parameter


def test_private_data_loader_checks_its_sampler_and_collates_empty_batches():
    data = TensorDataset(torch.randn(12, 3), torch.randint(0, 2, (12,)))
    loader = private_data_loader(
        data, sampler=BallsInBinsBatchSampler(population_size=12, num_batches=12, seed=0)
    )
    shapes = [tuple(x.shape) for x, _ in loader]
    assert sum(s[0] for s in shapes) == 12 and (0, 3) in shapes  # 12 bins for 12 records
    with pytest.raises(InvalidParameterError, match="population_size"):
        private_data_loader(data, sampler=ShuffleBatchSampler(population_size=11, batch_size=2))
    with pytest.raises(InvalidParameterError) as info:
        private_data_loader(data, sampler=torch.utils.data.SequentialSampler(data))
    assert info.value.parameter == "sampler"
    with pytest.raises(InvalidParameterError) as info:
        private_data_loader(
            data, sampler=ShuffleBatchSampler(population_size=12, batch_size=2), batch_size=3
        )
    assert info.value.parameter == "batch_size"


# ---------------------------------------------------------------------------- DP training
N, DIM = 48, 4


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(N, DIM, generator=g, dtype=torch.float64),
        torch.randint(0, 3, (N,), generator=g),
    )


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 5), nn.Tanh(), nn.Linear(5, 3)).double()


SAMPLERS = {
    "poisson": lambda: PoissonBatchSampler(population_size=N, sampling_probability=0.25, seed=1),
    "fixed_size": lambda: FixedSizeBatchSampler(population_size=N, batch_size=12, seed=1),
    "truncated_poisson": lambda: TruncatedPoissonBatchSampler(
        population_size=N, sampling_probability=0.25, max_batch_size=10, seed=1
    ),
    "balls_in_bins": lambda: BallsInBinsBatchSampler(population_size=N, num_batches=4, seed=1),
    "shuffle": lambda: ShuffleBatchSampler(population_size=N, batch_size=10, seed=1),
}


# The accountant that certifies each scheme (see the README's sampling table).
CERTIFIED_BY = {
    "poisson": "rdp",
    "fixed_size_without_replacement": "rdp",
    "truncated_poisson": "pld",
    "balls_in_bins": "rdp",
    "shuffle": "rdp",
}


def _epsilon(ledger: PrivacyLedger) -> float:
    """ε at δ = 1e-5 from the accountant that certifies the ledger's scheme."""
    (scheme,) = ledger.compressed().schemes
    return make_accountant(CERTIFIED_BY[scheme.value]).epsilon(ledger, delta=1e-5).epsilon


def _train(model, dp, loader, epochs, device="cpu"):
    for _ in range(epochs):
        for x, y in loader:
            dp.zero_grad()
            if len(x) == 0:
                dp.empty_step()
                continue
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()
            dp.step()


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_training_with_each_sampler_records_its_scheme_and_epochs(kind, device):
    sampler = SAMPLERS[kind]()
    event = sampler.sampling_event()
    relation = "add_remove" if "add_remove" in [r.value for r in event.relations] else "replace_one"
    ledger = PrivacyLedger(neighboring=relation)
    model = _model().to(device)
    loader = private_data_loader(_data(), sampler=sampler)
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        sampler=loader,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        ledger=ledger,
        seed=0,
    )
    assert dp.denominator == event.average_denominator
    assert dp.sampling_event == event
    _train(model, dp, loader, epochs=2, device=device)
    per_epoch = len(sampler)
    steps = list(ledger.steps())
    assert len(steps) == 2 * per_epoch == ledger.num_steps
    recorded = [s.sampling for s in steps]
    assert {e.scheme for e in recorded} == {event.scheme}
    if event.scheme.is_epoch_based:
        starts = [i for i, e in enumerate(recorded) if e.epoch_start]
        assert starts == [0, per_epoch]
        assert len(ledger.compressed().epoch_segments()) == 2
    else:
        assert all(e == event for e in recorded)
    assert math.isfinite(_epsilon(ledger))


@pytest.mark.parametrize(
    ("kind", "denominator"),
    [("fixed_size", 12.0), ("shuffle", 10.0), ("balls_in_bins", 12.0), ("poisson", 12.0)],
)
@pytest.mark.parametrize("device", DEVICES)
def test_the_average_divides_by_the_schemes_denominator(kind, denominator, device):
    """Noise-free, unclipped steps equal plain SGD on (sum of losses) / denominator, computed
    in float64 on a second model on the CPU: b for fixed-size and shuffled batches (the last,
    smaller shuffled batch too), n / k for balls-in-bins, q·n for Poisson."""
    data = _data()
    model, plain = _model().to(device), _model()
    loader = private_data_loader(data, sampler=SAMPLERS[kind]())
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        sampler=loader,
        l2_norm_bound=1e12,
        noise_multiplier=0.0,
        check_steps=0,
    )
    assert dp.denominator == denominator
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    sizes = []
    for x, y in loader:
        sizes.append(len(x))
        dp.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        dp.step()
        opt.zero_grad()
        (F.cross_entropy(plain(x), y, reduction="sum") / denominator).backward()
        opt.step()
    if kind == "shuffle":
        assert sizes == [10, 10, 10, 10, 8]
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-12, atol=1e-14, msg=name)


def test_bias_metrics_use_the_schemes_denominator():
    data = _data()
    model = _model()
    seen = []
    loader = private_data_loader(data, sampler=SAMPLERS["shuffle"]())
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        sampler=loader,
        l2_norm_bound=1e12,
        noise_multiplier=0.0,
        bias_callback=lambda step, metrics: seen.append(metrics),
    )
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    dp.step()
    assert seen and seen[0].denominator == 10.0


def test_a_batch_the_sampler_did_not_draw_is_refused_before_anything_is_recorded():
    data = _data()
    model = _model()
    ledger = PrivacyLedger(neighboring="replace_one")
    loader = private_data_loader(data, sampler=SAMPLERS["shuffle"]())
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        sampler=loader,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        ledger=ledger,
    )
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(DataLoader(data, batch_size=10, shuffle=True)))  # same size, not its draw
    with pytest.raises(SamplerMismatchError, match="drew no batch"):
        F.cross_entropy(model(x), y).backward()
        dp.step()
    assert ledger.num_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("kind", ["fixed_size", "shuffle"])
def test_a_ledger_the_scheme_is_not_analysed_under_is_refused_at_construction(kind):
    model = _model()
    with pytest.raises(InvalidParameterError, match="neighboring='replace_one'") as info:
        DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            sampler=SAMPLERS[kind](),
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            ledger=PrivacyLedger(neighboring="add_remove"),
        )
    assert info.value.parameter == "ledger"
    dp = DPOptimizer(  # no ledger given: an in-memory replace-one ledger
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        sampler=SAMPLERS[kind](),
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
    )
    assert dp.ledger.neighboring.value == "replace_one"


@pytest.mark.parametrize("kind", ["fixed_size", "truncated_poisson", "balls_in_bins", "shuffle"])
def test_samplers_other_than_distributed_poisson_are_refused_under_torch_distributed(kind):
    model = _model()
    with pytest.raises(InvalidParameterError, match="DistributedPoissonBatchSampler"):
        DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            sampler=SAMPLERS[kind](),
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            ledger=PrivacyLedger(neighboring="replace_one"),
            distributed=True,
        )


def test_a_checkpoint_in_the_middle_of_a_shuffled_epoch_resumes_the_same_run():
    def run(stop_after=None, state=None):
        model = _model()
        ledger = PrivacyLedger(neighboring="replace_one")
        loader = private_data_loader(_data(), sampler=SAMPLERS["shuffle"]())
        dp = DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            sampler=loader,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            ledger=ledger,
            seed=0,
        )
        dp.enable_bit_for_bit_resume()  # the explicit opt-in: generator states saved
        if state is not None:  # the resumed run: the ledger and model as at the checkpoint
            model.load_state_dict(state["model"])
            for event in state["events"]:
                if isinstance(event, SamplingEvent):
                    ledger.record_sample(event=event)
                else:
                    ledger.record_sum_query(
                        l2_norm_bound=event.l2_norm_bound,
                        noise_stddev=event.noise_stddev,
                        label=event.label,
                    )
            dp.load_state_dict(state["optimizer"])
        for steps, (x, y) in enumerate(loader, start=1):
            dp.zero_grad()
            F.cross_entropy(model(x), y).backward()
            dp.step()
            if steps == stop_after:
                return {
                    "model": {k: v.clone() for k, v in model.state_dict().items()},
                    "optimizer": dp.state_dict(),
                    "events": list(ledger.events()),
                }
        return model, ledger

    whole_model, whole_ledger = run()
    state = run(stop_after=2)
    resumed_model, resumed_ledger = run(state=state)
    assert list(resumed_ledger.events()) == list(whole_ledger.events())
    for a, b in zip(whole_model.parameters(), resumed_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [s.sampling.epoch_start for s in resumed_ledger.steps()] == [True] + [False] * 4
    assert SamplingScheme.SHUFFLE in resumed_ledger.compressed().schemes


# ---------------------------------------------------------------------------- make_private
def _make_private(data, **kwargs):
    model = _model()
    kwargs.setdefault("noise_multiplier", 1.0)
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        l2_norm_bound=1.0,
        seed=0,
        **kwargs,
    )


def test_make_private_replaces_a_shuffled_loader_by_poisson_with_q_b_over_n():
    data = _data()
    own = DataLoader(data, batch_size=12, shuffle=True)
    model, dp, loader = _make_private(own)
    sampler = loader.batch_sampler
    assert type(sampler) is PoissonBatchSampler
    assert sampler.sampling_probability == 12 / N and dp.denominator == 12.0
    x, y = next(iter(own))  # the user's own loader: refused, nothing recorded
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(SamplerMismatchError, match="drew no batch"):
        dp.step()
    assert dp.ledger.num_steps == 0
    _train(model, dp, loader, epochs=1)
    assert [s.sampling for s in dp.ledger.steps()] == [SamplingEvent.poisson(0.25, N)] * 4
    # an explicit q wins over the loader's batch size; a sequential loader is replaced alike
    _, dp, loader = _make_private(DataLoader(data, batch_size=5), sampling_probability=0.5)
    assert loader.batch_sampler.sampling_probability == 0.5


def test_make_private_keeps_shuffled_batches_when_asked_and_records_them_as_shuffle():
    data = _data()
    model, dp, loader = _make_private(
        DataLoader(data, batch_size=10, shuffle=True), sampling="shuffle"
    )
    sampler = loader.batch_sampler
    assert type(sampler) is ShuffleBatchSampler
    assert (sampler.batch_size, sampler.drop_last, len(loader)) == (10, False, 5)
    assert dp.ledger.neighboring.value == "replace_one" and dp.denominator == 10.0
    _train(model, dp, loader, epochs=2)
    recorded = [s.sampling for s in dp.ledger.steps()]
    assert recorded == [SamplingEvent.shuffle(10, N, epoch_start=i % 5 == 0) for i in range(10)]
    with pytest.raises(InvalidParameterError, match="does not divide"):
        _make_private(
            DataLoader(data, batch_size=10, shuffle=True, drop_last=True), sampling="shuffle"
        )
    with pytest.raises(InvalidParameterError, match="neighboring='replace_one'"):
        _make_private(data, sampling="shuffle", batch_size=10, ledger=PrivacyLedger())


@pytest.mark.parametrize(
    ("kwargs", "sampler_type", "event"),
    [
        ({"sampling": "fixed_size"}, FixedSizeBatchSampler, SamplingEvent.fixed_size(12, N)),
        (
            {"sampling": "truncated_poisson", "max_batch_size": 9},
            TruncatedPoissonBatchSampler,
            SamplingEvent.truncated_poisson(0.25, N, 9),
        ),
        ({"sampling": "balls_in_bins"}, BallsInBinsBatchSampler, SamplingEvent.balls_in_bins(4, N)),
        (
            {"sampling": "balls_in_bins", "num_batches": 6},
            BallsInBinsBatchSampler,
            SamplingEvent.balls_in_bins(6, N),
        ),
    ],
)
def test_make_private_builds_each_scheme_from_the_loaders_batch_size(kwargs, sampler_type, event):
    _, dp, loader = _make_private(DataLoader(_data(), batch_size=12, shuffle=True), **kwargs)
    assert type(loader.batch_sampler) is sampler_type
    assert loader.batch_sampler.sampling_event() == event
    assert dp.sampling_event == event


class _EveryOther(torch.utils.data.Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self):
        return self.n // 2


@pytest.mark.parametrize(
    ("make_loader", "advice"),
    [
        (
            lambda d: DataLoader(
                d, batch_size=4, sampler=WeightedRandomSampler([1.0] * N, num_samples=N)
            ),
            "unequal weights",
        ),
        (
            lambda d: DataLoader(d, batch_size=4, sampler=RandomSampler(d, replacement=True)),
            "FixedSizeBatchSampler",
        ),
        (
            lambda d: DataLoader(d, batch_size=4, sampler=RandomSampler(d, num_samples=10)),
            "num_samples",
        ),
        (
            lambda d: DataLoader(
                d, batch_size=4, sampler=DistributedSampler(d, num_replicas=2, rank=0)
            ),
            "DistributedPoissonBatchSampler",
        ),
        (
            lambda d: DataLoader(d, batch_size=4, sampler=_EveryOther(N)),
            "private_data_loader",
        ),
        (
            lambda d: DataLoader(d, batch_sampler=[[0, 1], [2, 3]]),
            "private_data_loader",
        ),
    ],
    ids=["weighted", "with_replacement", "num_samples", "distributed", "custom", "batch_sampler"],
)
def test_make_private_refuses_loaders_whose_sampling_it_cannot_reproduce(make_loader, advice):
    with pytest.raises(InvalidParameterError, match=advice) as info:
        _make_private(make_loader(_data()), sampling_probability=0.25)
    assert info.value.parameter == "data"


@pytest.mark.parametrize(
    ("data", "kwargs", "parameter"),
    [
        ("dataset", {}, "sampling_probability"),  # a data set has no batch size to derive q from
        ("dataset", {"sampling": "shuffle"}, "batch_size"),
        ("dataset", {"sampling": "truncated_poisson", "batch_size": 4}, "max_batch_size"),
        ("dataset", {"sampling": "balls_in_bins"}, "num_batches"),
        ("loader", {"sampling": "shuffle", "sampling_probability": 0.5}, "sampling_probability"),
        ("loader", {"sampling": "bootstrap"}, "sampling"),
        (
            "loader",
            {
                "sampling": "shuffle",
                "noise_multiplier": None,
                "target_epsilon": 1.0,
                "delta": 1e-5,
                "epochs": 1,
            },
            "target_epsilon",
        ),
    ],
)
def test_make_private_names_what_a_scheme_needs(data, kwargs, parameter):
    source = _data() if data == "dataset" else DataLoader(_data(), batch_size=8, shuffle=True)
    with pytest.raises(InvalidParameterError) as info:
        _make_private(source, **kwargs)
    assert info.value.parameter == parameter


def test_empty_balls_in_bins_batches_are_steps_and_virtual_batches_keep_one_event_per_step():
    data = TensorDataset(*_data()[:6])
    model = _model()
    loader = private_data_loader(
        data, sampler=BallsInBinsBatchSampler(population_size=6, num_batches=6, seed=0)
    )
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        sampler=loader,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        loss_reduction="sum",
    )
    sizes = []
    for _ in range(2):
        for x, y in loader:
            sizes.append(len(x))
            dp.zero_grad()
            F.cross_entropy(model(x), y, reduction="sum").backward()  # B = 0 runs too
            dp.step()
    assert 0 in sizes and sum(sizes) == 12
    assert [s.sampling.epoch_start for s in dp.ledger.steps()] == ([True] + [False] * 5) * 2

    model, dp, loader = _make_private(
        DataLoader(_data(), batch_size=10, shuffle=True),
        sampling="shuffle",
        max_physical_batch_size=4,
    )
    _train(model, dp, loader, epochs=1)
    recorded = [s.sampling for s in dp.ledger.steps()]
    assert recorded == [SamplingEvent.shuffle(10, N, epoch_start=i == 0) for i in range(5)]
