"""User-level central DP for Flower: a strategy wrapper that samples, clips, noises and records.

:class:`UserLevelDPStrategy` wraps any message-API Flower strategy (``FedAvg``, ``FedAdam``,
``FedProx``, …) and makes each training round one step of DP-FedAvg (McMahan et al. 2018) whose
record is one client's model update and whose unit of privacy is the user:

1. **Cohort.** ``configure_train`` draws the round's cohort itself, over the client population
   registered at the first round (``num_clients`` Flower nodes, sorted by node id), with a
   recorded sampler: Poisson with rate q (add/remove-one; :class:`~dpledger.sampling.PoissonScheme`)
   or ``cohort_size`` clients uniformly without replacement (replace-one;
   :class:`~dpledger.sampling.FixedSizeScheme`). The wrapped strategy is asked for its train
   message (its config, e.g. FedProx's μ) and its own choice of nodes is discarded.
2. **Clip.** ``aggregate_train`` turns each reply into the update Δ_i = w_i − w_global and clips
   it to L2 norm S on the server, or (``clipping="client"``) checks that the client clipped it:
   an update longer than S (up to rounding) refuses the round with
   :class:`~dpledger.errors.UpdateOverBoundError` before anything is recorded.
3. **Sum, noise, record.** The clipped updates are summed and released through the core's
   :class:`~dpledger.mechanisms.GaussianSumQuery` (or
   :class:`~dpledger.mechanisms.AdaptiveClipping`, Andrew et al. 2021, which also releases the
   noised count of unclipped updates as a second query (½, σ_b) of the same step):
   the step's sampling event (unit ``user``) and sum-query
   events reach the ledger file before the noised sum is returned (write-ahead).
4. **Average.** The noised sum is divided by the sampler's fixed denominator (q·n, or the cohort
   size), never by the number of clients that answered, and the wrapped strategy receives the
   result w_global + Δ̄ as the one reply of the round, so FedAvg keeps it and FedAdam takes its
   server step from it (post-processing).

**Clients that were sampled but did not answer** (a timeout, a dropped connection, an error
reply) contribute the zero update. The release is still the Gaussian sum query over the sampled
users with each contribution in the ball of radius S (0 is in it), so its sensitivity is S (2S
under replace-one) whatever subset answers, and the fixed denominator does not depend on who
answered; the ledger records the round like any other. Each round with silent clients gets a
ledger note ``{"flower_round": {"round": t, "sampled": k, "silent": s}}`` (no accountant reads
it) and :attr:`UserLevelDPStrategy.silent_clients` counts them.

Client metrics of the training replies are not private and are not passed on; the wrapped
strategy's evaluation rounds run as configured and are not accounted (evaluate on the server,
or treat client evaluation metrics as non-private).

**Correlated noise across rounds** (``correlated=CorrelatedNoiseSpec(...)``: DP-FTRL with tree
aggregation, BandMF or BLT). The cohorts are then the spec's cyclic groups
(:class:`~dpledger.sampling.CyclicScheme`: each client assigned once to one of ``period`` groups,
round t taking group t mod period, whole or Poisson-sampled within it), the ledger holds one
correlated release (the factorization, its sensitivity under the cyclic participation schema)
recorded before the first round's noise and a stream step per round, and each round's clipped
sum gets the stream's next noise instead of independent noise. Adaptive clipping, calibration
from a target ε and resume are refused in this mode.

**Resume.** Give the strategy the ledger reopened with ``PrivacyLedger(path, resume=True)``:
its earlier rounds stay in it, the new rounds are appended, and ε is over all of them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from dpledger.accountants.base import make_accountant
from dpledger.accountants.calibration import calibrate_noise_multiplier
from dpledger.errors import InvalidParameterError, SamplerMismatchError
from dpledger.integrations.flower.client import CLIP_NORM_KEY
from dpledger.integrations.flower.cohorts import cohort_scheme, round_event
from dpledger.integrations.flower.replies import check_client_clipping, client_updates
from dpledger.ledger import NeighboringRelation, PrivacyLedger, SamplingEvent
from dpledger.ledger.intent import note_intent, run_intent
from dpledger.mechanisms import AdaptiveClipping, GaussianSumQuery
from dpledger.mechanisms.averaging import fixed_denominator_average
from dpledger.mechanisms.correlated import CorrelatedNoiseRelease, CorrelatedNoiseSpec
from dpledger.mechanisms.step import open_step
from dpledger.mechanisms.sum_query_checks import check_sensitivity
from dpledger.sampling import CyclicScheme, FixedSizeScheme, PoissonScheme
from dpledger.validation import check_delta, check_non_negative_finite, check_positive_finite

__all__ = ["UserLevelDPStrategy"]

_log = logging.getLogger(__name__)

EPSILON_METRIC = "dpledger-epsilon"
"""The key of ε after the round in the metrics the wrapper returns (with ``delta`` given)."""


class _Round:
    """What ``configure_train`` drew for a round, kept until its aggregation."""

    __slots__ = ("cohort", "event", "reference")

    def __init__(
        self, cohort: list[int], event: SamplingEvent | None, reference: ArrayRecord
    ) -> None:
        self.cohort = cohort
        self.event = event
        self.reference = reference


class UserLevelDPStrategy(Strategy):
    """Central user-level DP around a Flower strategy, every round recorded in a ledger.

    Args:
        strategy: the wrapped message-API strategy (``flwr.serverapp.strategy.FedAvg``, …).
        ledger: the server's open :class:`~dpledger.PrivacyLedger`, under add/remove-one for
            Poisson cohorts and replace-one for fixed-size cohorts (or reopened with
            ``resume=True`` to continue a run).
        num_clients: n, the number of clients (users) the cohorts are drawn from; the first
            round waits up to ``registration_timeout`` seconds for exactly n nodes.
        l2_norm_bound: S > 0, the bound every client's update is clipped to (the initial bound
            with adaptive clipping).
        sampling_probability: q in (0, 1], each client's chance to be in a round's cohort
            (Poisson); or
        cohort_size: m in [1, n], clients per round drawn without replacement (fixed size).
        noise_multiplier: z ≥ 0 (σ̃ = z·S; z = 0 is recorded and not private); or
        target_epsilon: the ε to calibrate z for over ``num_rounds`` rounds at ``delta``
            (Poisson cohorts).
        delta: δ of the target, and of the ε logged after every round (None: no ε logged).
        num_rounds: the planned rounds of the calibration.
        accountant: the accountant that calibrates z and logs ε (``"rdp"`` default, ``"prv"``,
            ``"pld"``).
        clipping: ``"server"`` (default: the server clips) or ``"client"`` (the clients clip
            with :func:`~dpledger.integrations.flower.client.clip_client_update`; the server
            refuses an update over S).
        target_unclipped_quantile: γ in [0, 1] to adapt S towards (Andrew et al. 2021);
            None keeps S fixed.
        count_noise_stddev: σ_b of the unclipped count (default: the expected cohort / 20, the
            paper's choice); the update query's noise is raised so that the step's z is z.
        clip_learning_rate: η of the geometric update of S.
        correlated: a :class:`~dpledger.mechanisms.correlated.CorrelatedNoiseSpec` for correlated
            noise across rounds (its ``num_steps`` are the rounds): the spec's cyclic groups are
            the cohorts, so neither ``sampling_probability`` nor ``cohort_size`` is given; needs
            ``noise_multiplier`` > 0 and an add/remove ledger without a correlated release.
        seed: seeds the cohort draws and the noise (recorded in the ledger's intent as
            caller-given: the noise is then not secret); None draws from the OS.
        registration_timeout: seconds the first round waits for the n clients.

    Raises:
        InvalidParameterError: a bad or missing argument, a ledger under the wrong neighbouring
            relation, or both or neither of q and m, of z and the target.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        ledger: PrivacyLedger,
        num_clients: int,
        l2_norm_bound: float,
        sampling_probability: float | None = None,
        cohort_size: int | None = None,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        delta: float | None = None,
        num_rounds: int | None = None,
        accountant: str = "rdp",
        clipping: str = "server",
        target_unclipped_quantile: float | None = None,
        count_noise_stddev: float | None = None,
        clip_learning_rate: float = 0.2,
        correlated: CorrelatedNoiseSpec | None = None,
        seed: int | None = None,
        registration_timeout: float = 60.0,
    ) -> None:
        if not isinstance(strategy, Strategy):
            raise InvalidParameterError("strategy", strategy, "a flwr.serverapp.strategy.Strategy")
        if not isinstance(ledger, PrivacyLedger):
            raise InvalidParameterError("ledger", ledger, "a dpledger.PrivacyLedger")
        if clipping not in ("server", "client"):
            raise InvalidParameterError("clipping", clipping, '"server" or "client"')
        self.strategy = strategy
        self.ledger = ledger
        self.clipping = clipping
        self.delta = None if delta is None else check_delta("delta", delta)
        self.correlated = correlated
        self._release: CorrelatedNoiseRelease | None = None
        self.scheme = cohort_scheme(
            num_clients=num_clients, sampling_probability=sampling_probability,
            cohort_size=cohort_size, correlated=correlated, seed=seed,
        )  # fmt: skip
        relation = (
            NeighboringRelation.REPLACE_ONE
            if isinstance(self.scheme, FixedSizeScheme)
            else NeighboringRelation.ADD_REMOVE
        )
        if ledger.neighboring is not relation:
            raise InvalidParameterError(
                "ledger",
                f"a ledger under {ledger.neighboring.value}",
                f"a ledger under {relation.value} for {self.scheme.describe()} cohorts",
            )
        self.event = round_event(self.scheme)
        self.denominator = float(self.scheme.average_denominator)
        self.accountant = accountant
        z = self._noise_multiplier(noise_multiplier, target_epsilon, num_rounds)
        self.noise_multiplier = z
        bound = check_positive_finite("l2_norm_bound", l2_norm_bound)
        if correlated is not None and (target_unclipped_quantile is not None or z == 0.0):
            raise InvalidParameterError(
                "correlated", correlated, "None with adaptive clipping or noise_multiplier=0 "
                "(a correlated release has a fixed bound and positive noise)",
            )  # fmt: skip
        if correlated is not None and (ledger.num_steps or ledger.correlated_releases):
            raise InvalidParameterError(
                "ledger", ledger.path, "a ledger without earlier rounds for correlated= (a "
                "correlated stream is not resumed: its noise and groups continue only in-process)",
            )  # fmt: skip
        self._seed = seed
        self._adaptive: AdaptiveClipping | None = None
        self._query: GaussianSumQuery | None = None
        if target_unclipped_quantile is not None:
            self._adaptive = AdaptiveClipping(
                initial_l2_norm_bound=bound,
                target_unclipped_quantile=target_unclipped_quantile,
                noise_multiplier=z,
                count_noise_stddev=(
                    self.denominator / 20.0 if count_noise_stddev is None else count_noise_stddev
                ),
                expected_batch_size=self.denominator,
                learning_rate=clip_learning_rate,
                label="update",
            )
        else:
            self._query = GaussianSumQuery(
                l2_norm_bound=bound, noise_stddev=z * bound, label="update"
            )
        self.registration_timeout = check_non_negative_finite(
            "registration_timeout", registration_timeout
        )
        self._rng = np.random.default_rng(seed)
        self.population: list[int] | None = None
        self._pending: dict[int, _Round] = {}
        self.cohorts: dict[int, list[int]] = {}
        self.silent_clients = 0
        self.epsilons: dict[int, float] = {}
        intent = run_intent(
            framework="flower",
            framework_version=_flwr_version(),
            population_size=self.scheme.population_size,
            unit="user",
            noise_multiplier=z,
            target_epsilon=target_epsilon,
            delta=self.delta,
            accountant=accountant if target_epsilon is not None else None,
            sampling=self.scheme.describe(),
            sampling_probability=self.scheme.sampling_probability,
            steps=num_rounds,
        )
        if seed is not None:
            intent["seed"] = "caller-given (cohorts and noise are reproducible)"
        note_intent(ledger, intent)

    def _noise_multiplier(
        self, noise_multiplier: float | None, target_epsilon: float | None, num_rounds: Any
    ) -> float:
        if (noise_multiplier is None) == (target_epsilon is None):
            raise InvalidParameterError(
                "noise_multiplier", noise_multiplier, "exactly one of noise_multiplier and "
                "target_epsilon (with delta and num_rounds)",
            )  # fmt: skip
        if noise_multiplier is not None:
            return check_non_negative_finite("noise_multiplier", noise_multiplier)
        if not isinstance(self.scheme, PoissonScheme):
            raise InvalidParameterError(
                "target_epsilon", target_epsilon, "None with cohort_size= or correlated= "
                "(calibration plans Poisson rounds; give noise_multiplier=)",
            )  # fmt: skip
        if self.delta is None or num_rounds is None:
            raise InvalidParameterError(
                "num_rounds", num_rounds, "the planned rounds, with delta, for target_epsilon"
            )
        result = calibrate_noise_multiplier(
            target_epsilon=target_epsilon,
            delta=self.delta,
            sampling_probability=self.scheme.sampling_probability,
            steps=num_rounds,
            accountant=self.accountant,
            population_size=self.scheme.population_size,
        )
        return float(result.value)

    @property
    def l2_norm_bound(self) -> float:
        """S of the next round (it moves with adaptive clipping)."""
        if self._adaptive is not None:
            return self._adaptive.l2_norm_bound
        assert self._query is not None
        return self._query.l2_norm_bound

    def _register(self, grid: Grid) -> list[int]:
        if self.population is not None:
            return self.population
        n = self.scheme.population_size
        deadline = time.monotonic() + self.registration_timeout
        while True:
            nodes = sorted(int(i) for i in grid.get_node_ids())
            if len(nodes) >= n or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if len(nodes) != n:
            raise InvalidParameterError(
                "num_clients", n, f"the number of registered Flower nodes ({len(nodes)})"
            )
        self.population = nodes
        return nodes

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Draw the round's cohort and send it the wrapped strategy's train message."""
        population = self._register(grid)
        if self.clipping == "client":
            config[CLIP_NORM_KEY] = self.l2_norm_bound
        inner = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if not inner:
            raise InvalidParameterError(
                "strategy", self.strategy, "a strategy that configures training every round"
            )
        template = inner[0]
        if isinstance(self.scheme, CyclicScheme):
            indices = self.scheme.draw(len(self.cohorts))  # refuses a round past the stream's T
        else:
            indices = self.scheme.draw(self._rng)
        cohort = [population[int(i)] for i in indices]
        self._pending[server_round] = _Round(cohort, self.event, arrays)
        self.cohorts[server_round] = cohort
        _log.info(
            "round %d: cohort of %d of %d clients", server_round, len(cohort), len(population)
        )
        return [
            Message(
                content=template.content,
                dst_node_id=node,
                message_type=template.metadata.message_type or MessageType.TRAIN,
            )
            for node in cohort
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip, sum, noise and record the round, average over the fixed denominator, and hand
        w_global + Δ̄ to the wrapped strategy."""
        drawn = self._pending.pop(server_round, None)
        if drawn is None:
            raise SamplerMismatchError(
                f"round {server_round} has no cohort drawn by configure_train; refused"
            )
        key = getattr(self.strategy, "arrayrecord_key", "arrays")
        updates = client_updates(drawn.reference, drawn.cohort, list(replies), arrayrecord_key=key)
        keys, reference, members, reported = (
            updates.keys,
            updates.reference,
            updates.members,
            updates.reported,
        )
        silent = len(drawn.cohort) - len(updates.repliers)
        query = self._adaptive.query if self._adaptive is not None else self._query
        assert query is not None
        norms = query.record_norms(members)
        if self.clipping == "client":
            check_client_clipping(updates, norms, bound=query.l2_norm_bound)
        factors = query.clip_factors(norms)
        sums = query.clipped_sums(members, factors)
        if self._adaptive is not None and self.clipping == "client":
            # the count uses the clients' reported (unclipped) norms; missing ones count as
            # clipped. Each client still moves the count by ½ at most, whatever it reports.
            norms = np.array([math.inf if r is None else r for r in reported], dtype=np.float64)
        if self.correlated is not None:
            noised = self._correlated_release(sums, len(norms), query.l2_norm_bound)
        else:
            noised = self._release_round(drawn, query, sums, norms)
        average = fixed_denominator_average(noised, denominator=self.denominator)
        if silent:
            self.silent_clients += silent
            self.ledger.record_note(
                {"flower_round": {"round": server_round, "sampled": len(drawn.cohort),
                                  "silent": silent}}
            )  # fmt: skip
        originals = drawn.reference.to_numpy_ndarrays()
        new = ArrayRecord(
            {
                k: Array(np.asarray(b + d).astype(o.dtype))
                for k, b, d, o in zip(keys, reference, average, originals, strict=True)
            }
        )
        metrics = MetricRecord({getattr(self.strategy, "weighted_by_key", "num-examples"): 1})
        content = RecordDict({getattr(self.strategy, "arrayrecord_key", "arrays"): new,
                              "metrics": metrics})  # fmt: skip
        synthetic = Message(content=content, dst_node_id=0, message_type=MessageType.TRAIN)
        arrays, _ = self.strategy.aggregate_train(server_round, [synthetic])
        return arrays, self._epsilon_metrics(server_round)

    def _release_round(
        self, drawn: _Round, query: GaussianSumQuery, sums: list[np.ndarray], norms: np.ndarray
    ) -> list[Any]:
        """Record the round's sampling event, release its sum (and count) queries."""
        step = open_step(self.ledger, event=drawn.event, generator=self._rng)
        if self._adaptive is not None:
            noised = self._adaptive.release(
                sums, norms=norms, ledger=self.ledger, generator=self._rng
            )
        else:
            noised = step.release(query, sums, num_records=len(norms))
        step.end()
        return list(noised)

    def _correlated_release(self, sums: list[np.ndarray], count: int, bound: float) -> list[Any]:
        """The round's clipped sum plus the correlated stream's next noise (the stream step is
        recorded first; the release itself before the first round's noise)."""
        assert self.correlated is not None
        flat = np.concatenate([np.ravel(s) for s in sums])
        check_sensitivity(
            float(np.linalg.norm(flat)), num_records=count, bound=bound,
            eps=float(np.finfo(np.float64).eps), size=flat.size,
        )  # fmt: skip
        if self._release is None:
            spec = self.correlated
            self._release = CorrelatedNoiseRelease(
                self.ledger, spec.factorization(), spec.schema(), l2_norm_bound=bound,
                noise_stddev=self.noise_multiplier * bound, dim=flat.size, label="update",
                sampling_probability=spec.sampling_probability if spec.amplified else None,
                seed=self._seed,
            )  # fmt: skip
        noised = flat + self._release.next_noise()
        out, start = [], 0
        for s in sums:
            out.append(noised[start : start + s.size].reshape(s.shape))
            start += s.size
        return out

    def _epsilon_metrics(self, server_round: int) -> MetricRecord | None:
        if self.delta is None:
            return None
        result = make_accountant(self.accountant).epsilon(self.ledger, delta=self.delta)
        self.epsilons[server_round] = float(result.value)
        _log.info(
            "round %d: user-level epsilon = %.4g at delta = %g (%s, %s)",
            server_round, result.value, self.delta, self.accountant, result.kind.value,
        )  # fmt: skip
        return MetricRecord({EPSILON_METRIC: float(result.value)})

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's evaluation round (not accounted)."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The wrapped strategy's aggregation of evaluation metrics (not private)."""
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        """Log the DP settings, then the wrapped strategy's summary."""
        _log.info(
            "user-level DP: %s, S=%g, z=%g, %s clipping, ledger %s",
            self.scheme.describe(), self.l2_norm_bound, self.noise_multiplier, self.clipping,
            self.ledger.path,
        )  # fmt: skip
        self.strategy.summary()


def _flwr_version() -> str:
    from importlib.metadata import version

    return version("flwr")
