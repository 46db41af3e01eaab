"""The batch sampler of a correlated-noise release: cyclic groups, whole or Poisson-sampled.

:class:`CyclicBatchSampler` draws the batches of a :class:`~dpledger.sampling.CyclicScheme`:
step t of the stream uses group t mod period (``docs/correlated-noise.md``). It is the only
sampler a :class:`~dpledger.adapters.torch.DPOptimizer` with ``noise=`` a
:class:`~dpledger.mechanisms.correlated.CorrelatedNoiseSpec` accepts, because the release it
records states the scheme's participation (:meth:`~dpledger.sampling.CyclicScheme.participation`),
and each step claims the draw of *its* step of the stream (:meth:`CyclicBatchSampler.claim_step`):
a batch from another loader, a batch of another step, or a skipped batch is refused before
anything is released.

One pass over the sampler is one epoch (``period`` steps, fewer at the end of the stream); the
pass continues the stream from the first step not yet claimed, and yields nothing once all T
steps were claimed. The draws depend only on the scheme's seed and the step, so a run resumed
from a checkpoint (:meth:`CyclicBatchSampler.state_dict`, which holds the scheme with its seed)
draws the same batches, also in a sampler built with another seed (``seed=None``): the
checkpoint's scheme takes over.

Its draws record no sampling event: the stream's steps are covered by the one correlated
release. :meth:`CyclicBatchSampler.sampling_event` refuses, so that a ``DPOptimizer`` with
independent noise refuses this sampler.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dpledger.adapters.torch.sampler_base import RecordedBatchSampler
from dpledger.errors import InvalidParameterError, SamplerMismatchError
from dpledger.ledger import SamplingEvent
from dpledger.mechanisms.correlated.spec import CorrelatedNoiseSpec
from dpledger.sampling.cyclic import CyclicScheme
from dpledger.sampling.draws import PendingDraws

__all__ = ["CyclicBatchSampler"]

_SCHEME_KEYS = {"population_size", "period", "num_steps", "sampling_probability", "seed"}


class CyclicBatchSampler(RecordedBatchSampler):
    """Batches of a cyclic scheme, one stream step each (see the module docstring).

    Args:
        scheme: the :class:`~dpledger.sampling.CyclicScheme` to draw.

    Raises:
        InvalidParameterError: ``scheme`` is not a ``CyclicScheme``.
    """

    def __init__(self, *, scheme: CyclicScheme) -> None:
        if not isinstance(scheme, CyclicScheme):
            raise InvalidParameterError("scheme", scheme, "a dpledger.sampling.CyclicScheme")
        super().__init__(population_size=scheme.population_size, seed=scheme.seed)
        self._cyclic = scheme
        self._next_claim = 0  # the first step of the stream not claimed yet

    @classmethod
    def for_spec(
        cls, spec: CorrelatedNoiseSpec, *, population_size: int, seed: int
    ) -> CyclicBatchSampler:
        """The sampler of ``spec``'s cyclic scheme over ``population_size`` records."""
        if not isinstance(spec, CorrelatedNoiseSpec):
            raise InvalidParameterError("spec", spec, "a CorrelatedNoiseSpec")
        return cls(scheme=spec.scheme(population_size=population_size, seed=seed))

    @property
    def cyclic_scheme(self) -> CyclicScheme:
        """The scheme drawn."""
        return self._cyclic

    @property
    def next_step(self) -> int:
        """The stream step the next claimed batch must be."""
        return self._next_claim

    @property
    def denominator(self) -> float:
        """The fixed denominator of the average: the expected batch size (n / period)·q."""
        return self._cyclic.average_denominator

    def sampling_event(self, *, epoch_start: bool = False) -> SamplingEvent:
        """Refused: a cyclic draw records no sampling event of its own.

        Raises:
            InvalidParameterError: always, naming what to use instead.
        """
        raise InvalidParameterError(
            "sampler",
            f"CyclicBatchSampler({self._cyclic.describe()})",
            "a sampler with a sampling event for independent noise: a cyclic sampler's "
            "batches are covered only by a correlated-noise release; use "
            "DPOptimizer(..., noise=CorrelatedNoiseSpec(...)) or "
            "make_private(..., noise=spec) with this sampler",
        )

    def _describe(self) -> str:
        return f"CyclicBatchSampler, {self._cyclic.describe()}"

    def __len__(self) -> int:
        return max(0, min(self._cyclic.period, self._cyclic.num_steps - self._next_claim))

    def __iter__(self) -> Iterator[list[int]]:
        self._new_pass()
        start = self._next_claim
        for t in range(start, start + len(self)):
            batch = self._cyclic.draw(t).tolist()
            self._note_draw(len(batch), None, t)
            yield batch

    def claim_draw(self, num_records: int) -> SamplingEvent:
        """Refused: steps of a correlated stream claim with :meth:`claim_step`.

        Raises:
            InvalidParameterError: always.
        """
        return self.sampling_event()

    def claim_step(self, num_records: int, *, step: int) -> None:
        """Tie stream step ``step`` to the oldest unclaimed draw, which must be that step's.

        Raises:
            SamplerMismatchError: no draw is waiting (the records came from another loader), the
                oldest draw is of another step (a batch was skipped), or it has another number
                of records. The draw is consumed either way.
        """
        draw = self._draws.claim(num_records, describe_sampler=self._describe)
        if draw.position != step:
            raise SamplerMismatchError(
                f"step {step} of the correlated-noise stream, but the oldest batch the cyclic "
                f"sampler drew is step {draw.position}'s: a batch was skipped or trained out of "
                "order, and the release's participation pattern would not describe the run; "
                "every step of the stream must train on its own batch. Nothing was recorded"
            )
        PendingDraws.check_size(draw, num_records)

    def step_released(self, step: int) -> None:
        """Stream step ``step`` was released: the next pass starts after it.

        A step refused after its claim (a failed sensitivity check) is not released: the next
        pass draws its batch again, and the stream's noise of that step is still unused.
        """
        self._next_claim = step + 1

    def state_dict(self) -> dict[str, Any]:
        """The next stream step to claim and the scheme (the draws depend only on the scheme,
        its seed included, and the step)."""
        c = self._cyclic
        return {
            "next_step": self._next_claim,
            "scheme": {
                "population_size": c.population_size,
                "period": c.period,
                "num_steps": c.num_steps,
                "sampling_probability": c.sampling_probability,
                "seed": c.seed,
            },
        }

    def scheme_of_state(self, state: Any) -> CyclicScheme:
        """The scheme a :meth:`state_dict` was taken of, checked against this sampler's.

        Only the seed may differ: a sampler built with ``seed=None`` (``make_private``'s
        default) drew a partition of its own, and the checkpoint's scheme — the partition and
        the Poisson draws the run's earlier steps used — takes over on :meth:`load_state_dict`.

        Raises:
            InvalidParameterError: not a state of this class, or a scheme with another
                population, period, T or q.
        """
        saved = state.get("scheme") if isinstance(state, dict) else None
        if not isinstance(saved, dict) or set(saved) != _SCHEME_KEYS:
            raise InvalidParameterError(
                "state['scheme']", saved, "the scheme of a CyclicBatchSampler.state_dict()"
            )
        scheme = CyclicScheme(**saved)
        mine, theirs = self._cyclic, scheme
        if (mine.population_size, mine.period, mine.num_steps, mine.sampling_probability) != (
            theirs.population_size,
            theirs.period,
            theirs.num_steps,
            theirs.sampling_probability,
        ):
            raise InvalidParameterError(
                "state['scheme']",
                theirs.describe(),
                f"the scheme {mine.describe()} (only its seed may differ)",
            )
        return scheme

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` of a sampler of the same scheme up to its seed; the
        checkpoint's scheme (its seed) takes over, so the batches are the checkpointed run's.

        Raises:
            InvalidParameterError: the state is of another scheme (:meth:`scheme_of_state`),
                or its step is out of range.
        """
        scheme = self.scheme_of_state(state)
        step = state.get("next_step")
        if type(step) is not int or not 0 <= step <= scheme.num_steps:
            raise InvalidParameterError("state['next_step']", step, f"0..{scheme.num_steps}")
        self._draws.clear()
        self._cyclic = scheme
        self._next_claim = step

    def reseed(self, seed: int) -> None:
        """Refused: a cyclic stream's draws are fixed by its scheme.

        Raises:
            InvalidParameterError: always.
        """
        raise InvalidParameterError(
            "seed", seed, "no reseeding: the cyclic partition is fixed for the whole stream"
        )

    def __repr__(self) -> str:
        return f"CyclicBatchSampler(scheme={self._cyclic!r})"
