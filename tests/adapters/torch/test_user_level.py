"""User-level DP: Poisson samples of users, per-user clipping, and the events of a user-level run.

Statistical tests use fixed seeds and tolerances of about 4 standard errors of the statistic
(4.5 for the largest of a few dozen z-scores). The clipped sums are compared with a float64
reference that runs one plain backward per user.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpledger import PrivacyLedger
from dpledger.accountants import make_accountant
from dpledger.adapters.torch import (
    DPOptimizer,
    PoissonBatchSampler,
    UserPoissonBatchSampler,
    make_private,
    private_data_loader,
)
from dpledger.adapters.torch.virtual_batches import virtual_batches
from dpledger.errors import InvalidParameterError, SamplerMismatchError, UnsupportedSamplingError
from dpledger.ledger import PrivacyUnit, SamplingEvent, SamplingScheme
from tests.adapters.torch.reference import DEVICES

# 12 users owning 1..9 records; labels are strings, in a shuffled order of records
_COUNTS = [1, 3, 9, 2, 7, 4, 1, 6, 9, 5, 2, 8]


def _user_ids(counts=_COUNTS, seed=0):
    labels = [f"u{u}" for u, c in enumerate(counts) for _ in range(c)]
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed)).tolist()
    return [labels[i] for i in order]


def _data(num_records, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_records, 4, generator=g, dtype=torch.float64) * scale
    y = torch.randint(0, 3, (num_records,), generator=g)
    return x, y


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(torch.float64)


def _optimizer(model, sampler, **kwargs):
    kwargs.setdefault("noise_multiplier", 0.0)
    kwargs.setdefault("l2_norm_bound", 0.5)
    return DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=kwargs.pop("lr", 0.0)),
        model=model,
        sampler=sampler,
        seed=0,
        **kwargs,
    )


def _reference_sum(model, x, y, labels, *, groups, bounds, mean=False, rule="flat"):
    """Σ_u f_u G_u: G_u by a backward of user u's summed (or mean) loss, factors per group."""
    clean = _model()  # a copy without the optimizer's hooks
    clean.load_state_dict(model.state_dict())
    model = clean
    params = dict(model.named_parameters())
    out = {n: torch.zeros_like(p) for n, p in params.items()}
    for user in dict.fromkeys(labels):
        rows = [i for i, label in enumerate(labels) if label == user]
        loss = F.cross_entropy(model(x[rows]), y[rows], reduction="mean" if mean else "sum")
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
        for members, bound in zip(groups, bounds, strict=True):
            norm = math.sqrt(sum(grads[n].square().sum().item() for n in members))
            if rule == "flat":
                f = min(1.0, bound / norm) if norm > 0 else 1.0
            elif rule == "global":
                f = 1.0 if norm <= bound else 0.0
            else:  # automatic, stability 0.01
                f = bound / (norm + 0.01)
            for n in members:
                out[n] += f * grads[n]
    return out


# ---------------------------------------------------------------------------- the sampler
@pytest.mark.statistical
def test_users_are_sampled_with_probability_q_and_at_most_k_records_each():
    ids = _user_ids()
    q, k, steps = 0.3, 4, 4000
    sampler = UserPoissonBatchSampler(ids, q, k, seed=3, steps=steps)
    assert sampler.num_users == len(_COUNTS) and sampler.population_size == len(ids)
    assert sampler.users == tuple(dict.fromkeys(ids))
    first = {u: ids.index(u) for u in sampler.users}
    included = dict.fromkeys(sampler.users, 0)
    record_hits = torch.zeros(len(ids), dtype=torch.float64)
    for batch in sampler:
        assert len(set(batch)) == len(batch)
        users = [ids[i] for i in batch]
        runs = list(dict.fromkeys(users))
        # grouped by user (each user's records consecutive), users in first-record order
        assert users == [u for u in runs for _ in range(users.count(u))]
        assert runs == sorted(runs, key=first.get)
        for u in runs:
            mine = [i for i in batch if ids[i] == u]
            assert mine == sorted(mine)
            assert len(mine) == min(k, _COUNTS[int(u[1:])])  # all, or exactly k
            included[u] += 1
        record_hits[batch] += 1
    z = [(c - steps * q) / math.sqrt(steps * q * (1 - q)) for c in included.values()]
    assert max(abs(v) for v in z) < 4.5  # 12 users: P(any |Z| > 4.5) ≈ 1e-4
    # a record of a user with m records is in the batch with probability q·min(1, k/m): the
    # subset of k is uniform, so every record of the user is equally likely
    for i, user in enumerate(ids):
        m = _COUNTS[int(user[1:])]
        p = q * min(1.0, k / m)
        assert abs(record_hits[i].item() - steps * p) < 4.5 * math.sqrt(steps * p * (1 - p))


@pytest.mark.statistical
def test_the_kept_subset_of_a_large_user_is_uniform_over_pairs():
    # one user with 6 records, k = 2: each of the 15 pairs is kept with probability 1/15
    ids = [0] * 6 + [1]
    sampler = UserPoissonBatchSampler(ids, 1.0, 2, seed=5, steps=6000)
    pairs: dict[tuple[int, ...], int] = {}
    for batch in sampler:
        assert batch[-1] == 6 and len(batch) == 3
        pairs[tuple(batch[:2])] = pairs.get(tuple(batch[:2]), 0) + 1
    assert len(pairs) == 15
    p = 1 / 15
    for count in pairs.values():
        assert abs(count - 6000 * p) < 4.5 * math.sqrt(6000 * p * (1 - p))


def test_the_sampler_records_a_user_level_poisson_event_and_says_whose_records_a_batch_holds():
    ids = torch.tensor([7, 3, 7, 7, 5, 3])
    sampler = UserPoissonBatchSampler(ids, 0.5, 2, seed=0)
    event = sampler.sampling_event()
    assert event == SamplingEvent.poisson(0.5, 3, unit="user")
    assert event.unit is PrivacyUnit.USER
    assert sampler.denominator == 1.5 == event.average_denominator
    assert sampler.users == (7, 3, 5) and sampler.records_per_user.tolist() == [3, 2, 1]
    full = UserPoissonBatchSampler(ids, 1.0, 3, seed=0)
    assert full.sampling_event().scheme is SamplingScheme.FULL
    batch = full.sample()
    assert batch == [0, 2, 3, 1, 5, 4]
    claimed, users = full.claim_users(len(batch))
    assert claimed.unit is PrivacyUnit.USER and claimed.population_size == 3
    assert users.user_index.tolist() == [0, 0, 0, 1, 1, 2]
    assert users.num_users == 3 and users.users == (7, 3, 5)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"user_ids": []}, "user_ids"),
        ({"user_ids": torch.zeros(2, 2, dtype=torch.int64)}, "user_ids"),
        ({"user_ids": torch.zeros(3)}, "user_ids"),
        ({"user_ids": "abc"}, "user_ids"),
        ({"user_ids": [[1], [2]]}, "user_ids"),
        ({"sampling_probability": 0.0}, "sampling_probability"),
        ({"sampling_probability": 1.5}, "sampling_probability"),
        ({"max_records_per_user": 0}, "max_records_per_user"),
        ({"steps": 0}, "steps"),
    ],
)
def test_the_sampler_refuses_bad_arguments(kwargs, name):
    args = {"user_ids": [0, 1, 1], "sampling_probability": 0.5, "max_records_per_user": 2}
    args.update(kwargs)
    with pytest.raises(InvalidParameterError, match=name):
        UserPoissonBatchSampler(**args)


def test_a_sampler_state_resumes_the_same_draws():
    ids = _user_ids()
    sampler = UserPoissonBatchSampler(ids, 0.4, 3, seed=11, steps=3)
    list(sampler)
    state = sampler.state_dict(include_generator_state=True)  # the bit-for-bit opt-in
    following = list(sampler)
    other = UserPoissonBatchSampler(ids, 0.4, 3, seed=99, steps=3)
    other.load_state_dict(state)
    assert list(other) == following
    smaller = UserPoissonBatchSampler(ids[:-1], 0.4, 3, seed=0)
    with pytest.raises(InvalidParameterError, match="state"):
        smaller.load_state_dict(state)


# ---------------------------------------------------------------------------- DP steps
def _indexed(ids, **data_kwargs):
    x, y = _data(len(ids), **data_kwargs)
    return TensorDataset(x, y, torch.arange(len(ids))), x, y


@pytest.mark.parametrize("user_gradient", ["sum", "mean"])
@pytest.mark.parametrize("groups", ["all", "per_layer"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_released_sum_is_the_per_user_clipped_sum_of_a_loop_reference(
    user_gradient, groups, device
):
    """The optimizer on each device; the reference on the CPU."""
    ids = _user_ids()
    dataset, _, _ = _indexed(ids, scale=3.0)
    sampler = UserPoissonBatchSampler(ids, 0.6, 5, seed=2, steps=4)
    loader = private_data_loader(dataset, sampler=sampler)
    model = _model().to(device)
    dp = _optimizer(model, loader, groups=groups, user_gradient=user_gradient, l2_norm_bound=0.3)
    members = [tuple(m) for m in dp.queries.members]
    bounds = [q.l2_norm_bound * (1 - dp._clip_margin) for q in dp.queries.queries]
    clipped_any = False
    for x, y, idx in loader:
        labels = [ids[i] for i in idx.tolist()]
        dp.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        dp.step()
        want = _reference_sum(
            model, x, y, labels, groups=members, bounds=bounds, mean=user_gradient == "mean"
        )
        for n, p in model.named_parameters():
            got = p.grad.cpu() * dp.denominator
            torch.testing.assert_close(got, want[n], rtol=1e-9, atol=1e-12)
        # the reference clipped some users and left others: both branches were compared
        whole = _reference_sum(
            model, x, y, labels, groups=members, bounds=[1e9] * len(bounds), mean=False
        )
        clipped_any |= any(not torch.allclose(whole[n], want[n]) for n in want)
    assert clipped_any
    assert dp.ledger.num_steps == 4


def test_the_functional_path_clips_per_user_too():
    ids = _user_ids()
    dataset, _, _ = _indexed(ids, scale=3.0)
    sampler = UserPoissonBatchSampler(ids, 0.6, 5, seed=4, steps=2)
    loader = private_data_loader(dataset, sampler=sampler)
    model = _model()
    dp = _optimizer(model, loader, loss_fn=F.cross_entropy, l2_norm_bound=0.3)
    bound = 0.3 * (1 - dp._clip_margin)
    for x, y, idx in loader:
        labels = [ids[i] for i in idx.tolist()]
        dp.zero_grad()
        dp.compute_gradients(x, y)
        dp.step()
        names = (tuple(n for n, _ in model.named_parameters()),)
        want = _reference_sum(model, x, y, labels, groups=names, bounds=[bound])
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad * dp.denominator, want[n], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("clipping", ["global", "automatic"])
def test_other_clipping_strategies_apply_to_each_users_vector(clipping):
    ids = _user_ids()
    dataset, _, _ = _indexed(ids, scale=3.0)
    sampler = UserPoissonBatchSampler(ids, 0.6, 5, seed=9, steps=3)
    loader = private_data_loader(dataset, sampler=sampler)
    model = _model()
    C = 5.0  # users' summed gradients have norms from about 2 to 8 here: some above, some below
    dp = _optimizer(model, loader, clipping=clipping, l2_norm_bound=C)
    bound = C * (1 - dp._clip_margin)
    names = (tuple(n for n, _ in model.named_parameters()),)
    kept, dropped = [], []
    for x, y, idx in loader:
        labels = [ids[i] for i in idx.tolist()]
        dp.zero_grad()
        F.cross_entropy(model(x), y).backward()
        dp.step()
        want = _reference_sum(model, x, y, labels, groups=names, bounds=[bound], rule=clipping)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad * dp.denominator, want[n], rtol=1e-9, atol=1e-12)
        whole = _reference_sum(model, x, y, labels, groups=names, bounds=[1e9])
        kept.append(sum(w.norm().item() for w in want.values()))
        dropped.append(any(not torch.allclose(whole[n], want[n]) for n in want))
    assert max(kept) > 0 and any(dropped)  # some users' vectors kept, some cut or dropped


def _released_sum(ids, x, y, *, l2_norm_bound):
    """The pre-noise clipped sum of one full step (q = 1, every user sampled)."""
    dataset = TensorDataset(x, y)
    sampler = UserPoissonBatchSampler(ids, 1.0, 50, seed=0, steps=1)
    loader = private_data_loader(dataset, sampler=sampler)
    model = _model()
    dp = _optimizer(model, loader, l2_norm_bound=l2_norm_bound)
    for xb, yb in loader:
        F.cross_entropy(model(xb), yb).backward()
        dp.step()
    return torch.cat([p.grad.flatten() * dp.denominator for p in model.parameters()])


def test_a_user_with_many_records_moves_the_released_sum_by_at_most_c():
    C = 0.5
    ids = _user_ids()
    x, y = _data(len(ids))
    # a planted user with 50 records whose gradients are huge: each record alone is far above C
    big_x, big_y = _data(50, seed=7, scale=1e3)
    big_x[:, 0] = 1e3  # every record pushes the same direction: their sum is 50 times larger
    with_user = _released_sum(
        ids + ["big"] * 50, torch.cat([x, big_x]), torch.cat([y, big_y]), l2_norm_bound=C
    )
    without = _released_sum(ids, x, y, l2_norm_bound=C)
    moved = (with_user - without).norm().item()
    assert moved <= C * (1 + 1e-9)
    assert moved > 0.99 * C  # its summed gradient was clipped onto the sphere of radius C


def test_a_user_level_run_records_user_events_and_epsilon_per_user():
    ids = _user_ids()
    dataset, _, _ = _indexed(ids)
    q = 0.5
    sampler = UserPoissonBatchSampler(ids, q, 3, seed=6, steps=5)
    loader = private_data_loader(dataset, sampler=sampler)
    ledger = PrivacyLedger()
    model = _model()
    dp = _optimizer(model, loader, ledger=ledger, noise_multiplier=1.0, l2_norm_bound=1.0, lr=0.1)
    assert dp.population_size == len(_COUNTS) and dp.denominator == q * len(_COUNTS)
    for x, y, _ in loader:
        dp.zero_grad()
        F.cross_entropy(model(x), y).backward()
        dp.step()
    steps = list(ledger.steps())
    assert len(steps) == 5
    assert all(s.sampling == SamplingEvent.poisson(q, len(_COUNTS), unit="user") for s in steps)
    assert all(s.queries[0].l2_norm_bound == 1.0 for s in steps)
    result = make_accountant("rdp").epsilon(ledger, delta=1e-5)
    assert result.details["unit"] == "user" and 0 < result.epsilon < math.inf
    # a record-level step in the same ledger: no accountant states one guarantee for a mix
    ledger.record_sample(event=SamplingEvent.poisson(0.1, len(ids)))
    ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    with pytest.raises(UnsupportedSamplingError, match="mixes units"):
        make_accountant("rdp").epsilon(ledger, delta=1e-5)


def test_empty_batches_of_users_are_steps_of_pure_noise():
    ids = _user_ids()
    dataset, _, _ = _indexed(ids)
    sampler = UserPoissonBatchSampler(ids, 0.05, 3, seed=1, steps=20)
    loader = private_data_loader(dataset, sampler=sampler)
    model = _model()
    dp = _optimizer(model, loader, noise_multiplier=1.0, lr=0.1)
    sizes = []
    for x, y, _ in loader:
        sizes.append(len(y))
        dp.zero_grad()
        if len(y):
            F.cross_entropy(model(x), y).backward()
            dp.step()
        else:
            dp.empty_step()
    assert 0 in sizes and any(sizes)
    assert dp.ledger.num_steps == 20


def test_the_draw_tie_refuses_a_foreign_batch_and_a_cut_batch():
    ids = _user_ids()
    dataset, _, _ = _indexed(ids)
    sampler = UserPoissonBatchSampler(ids, 0.8, 5, seed=0, steps=3)
    loader = private_data_loader(dataset, sampler=sampler)
    model = _model()
    dp = _optimizer(model, loader, noise_multiplier=1.0)
    x, y, _ = next(iter(DataLoader(dataset, batch_size=8, shuffle=True)))
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(SamplerMismatchError, match="drew no batch"):
        dp.step()
    assert dp.ledger.num_steps == 0
    with pytest.raises(InvalidParameterError, match="DPOptimizer"):  # would drop user sampling
        make_private(
            _model(),
            torch.optim.SGD(_model().parameters(), lr=0.1),
            loader,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
        )
    it = iter(loader)
    x, y, _ = next(it)
    F.cross_entropy(model(x[:-1]), y[:-1]).backward()  # a record cut after sampling
    with pytest.raises(SamplerMismatchError, match="drew a batch of"):
        dp.step()
    assert dp.ledger.num_steps == 0 and sampler.unclaimed_draws == 0
    x, y, _ = next(it)  # the next draw steps normally
    F.cross_entropy(model(x), y).backward()
    dp.step()
    assert dp.ledger.num_steps == 1


def test_a_checkpointed_user_level_run_resumes_the_same_steps():
    ids = _user_ids()
    dataset, _, _ = _indexed(ids)

    def run(stop_after=None, state=None):
        steps = 5 if state is None else 3  # the resumed run takes the remaining steps
        sampler = UserPoissonBatchSampler(ids, 0.5, 3, seed=8, steps=steps)
        loader = private_data_loader(dataset, sampler=sampler)
        model, ledger = _model(), PrivacyLedger()
        dp = _optimizer(model, loader, ledger=ledger, noise_multiplier=1.0, lr=0.1)
        dp.enable_bit_for_bit_resume()  # the explicit opt-in: generator states saved
        if state is not None:
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
        for done, (x, y, _) in enumerate(loader, start=1):
            dp.zero_grad()
            F.cross_entropy(model(x), y).backward()
            dp.step()
            if done == stop_after:
                return {
                    "model": copy.deepcopy(model.state_dict()),
                    "optimizer": dp.state_dict(),
                    "events": list(ledger.events()),
                }
        return model, ledger

    whole_model, whole_ledger = run()
    state = run(stop_after=2)
    resumed_model, resumed_ledger = run(state=state)
    assert list(resumed_ledger.events()) == list(whole_ledger.events())
    assert resumed_ledger.num_steps == 5
    for a, b in zip(whole_model.parameters(), resumed_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------------- refusals
def test_record_level_options_that_have_no_user_level_version_are_refused():
    ids = _user_ids()
    dataset, _, _ = _indexed(ids)
    sampler = UserPoissonBatchSampler(ids, 0.5, 3, seed=0)
    with pytest.raises(InvalidParameterError, match="user_gradient"):
        _optimizer(_model(), sampler, user_gradient="median")
    record_level = PoissonBatchSampler(population_size=len(ids), sampling_probability=0.5)
    with pytest.raises(InvalidParameterError, match="user_gradient"):
        _optimizer(_model(), record_level, user_gradient="mean")
    with pytest.raises(InvalidParameterError, match="bam_radius"):
        _optimizer(_model(), sampler, loss_fn=F.cross_entropy, bam_radius=0.1)
    with pytest.raises(InvalidParameterError, match="bias_callback"):
        _optimizer(_model(), sampler, bias_callback=lambda step, metrics: None)
    loader = private_data_loader(dataset, sampler=UserPoissonBatchSampler(ids, 0.9, 3, seed=0))
    model = _model()
    dp = _optimizer(model, loader, noise_multiplier=1.0)
    x, y, _ = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(InvalidParameterError, match="virtual batches"):
        dp.virtual_step()
    dp.zero_grad()  # the batch is skipped
    for xb, yb, _ in virtual_batches(loader, dp, max_physical_batch_size=4):
        F.cross_entropy(model(xb), yb).backward()
        with pytest.raises(InvalidParameterError, match="virtual batches"):
            dp.step()
        break
    assert dp.ledger.num_steps == 0
    with pytest.raises(InvalidParameterError, match="DPOptimizer"):  # would drop user sampling
        make_private(
            _model(),
            torch.optim.SGD(_model().parameters(), lr=0.1),
            loader,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
        )
