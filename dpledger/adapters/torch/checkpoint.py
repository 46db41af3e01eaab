"""Checkpoints of :class:`~dpledger.adapters.torch.optimizer.DPOptimizer`.

:class:`OptimizerCheckpoint` holds ``state_dict`` and ``load_state_dict``: the wrapped
optimizer's state with the noise generator, the sampler and the ledger position, and the rules
for resuming against a ledger that holds as many, more, or fewer steps than the checkpoint.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from typing import Any

import torch

from dpledger.adapters.torch.distributed import _common_seed, broadcast_tensors
from dpledger.errors import EngineStateError, InvalidParameterError, LedgerStateError

__all__ = ["OptimizerCheckpoint"]

logger = logging.getLogger("dpledger.adapters.torch.optimizer")

_STATE_VERSION = 1


class OptimizerCheckpoint:
    """``state_dict`` / ``load_state_dict`` of
    :class:`~dpledger.adapters.torch.optimizer.DPOptimizer` (a base class of it)."""

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state with the noise generator, the sampler and the ledger
        position, to be saved together with the model's ``state_dict()``.

        The ledger is flushed first, so that the ledger file holds at least every step this
        checkpoint counts.
        """
        if self._pending() or self._acc is not None:
            raise EngineStateError(
                "state_dict() in the middle of a step (a backward or virtual chunks waiting): "
                "checkpoint between steps"
            )
        ledger_position = None
        if self._ledger is not None:
            self._ledger.flush()
            ledger_position = {
                "num_steps": self._ledger.num_steps,
                "num_events": self._ledger.num_events,
                "path": self._ledger.path,
            }
        return {
            "version": _STATE_VERSION,
            "optimizer": self._opt.state_dict(),
            "noise_generator_state": self._generator.get_state(),
            "sampler": None if self._sampler is None else self._sampler.state_dict(),
            "steps_taken": self._steps_taken,
            "ledger": ledger_position,
            "l2_norm_bound": self.l2_norm_bound,
            "noise_multiplier": self.noise_multiplier,
            "correlated": None if self._stream is None else self._stream.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a checkpoint written by :meth:`state_dict`.

        The ledger must be the run's own ledger continued from its file
        (``PrivacyLedger(path, resume=True)``):

        * it holds exactly the checkpoint's steps: training continues after them;
        * it holds *more* steps (training went on after the checkpoint, then stopped): those
          steps stay in the ledger and count towards ε — their noise was drawn and their
          results may have been seen — and a warning says how many; nothing is ever dropped.
          The noise generator and the sampler are then reseeded from OS entropy instead of
          restored: restoring them would draw those steps' noise and Poisson samples again,
          and two releases with the same noise reveal the difference of their sums without
          noise while the ledger counts them as independent steps;
        * it holds *fewer* steps: :class:`~dpledger.errors.LedgerStateError`, since ε computed
          from it would leave out steps that were taken.

        With correlated noise (``noise=`` a spec) the checkpoint holds the stream's step p, its
        noise generator, the recorded release and the cyclic sampler's scheme: the run continues
        the same noise stream on the same batches (the checkpoint's scheme and noise seed take
        over from those this optimizer drew, e.g. with ``seed=None``), and the release, which
        must be in the ledger, is not recorded again. The ledger records
        every step of the stream, and its progress q for the release must equal p: a checkpoint
        behind it (q > p: training went on past the checkpoint, and continuing would add the
        noise of steps p .. q − 1 again to other gradients) is refused with
        :class:`~dpledger.ledger.correlated.NoiseStreamRollbackError`, a ledger behind it
        (q < p) with :class:`~dpledger.errors.LedgerStateError`, both before anything is restored.

        Raises:
            InvalidParameterError: not a state dict of this class.
            LedgerStateError: the ledger holds fewer steps than the checkpoint.
            NoiseStreamRollbackError: a correlated-noise checkpoint behind the ledger's progress.
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("version") != _STATE_VERSION:
            raise InvalidParameterError(
                "state_dict", type(state_dict).__name__, "a DPOptimizer.state_dict()"
            )
        position = state_dict.get("ledger")
        self._check_ledger_open()
        behind = False
        if self._ledger is not None and position is not None:
            have, want = self._ledger.num_steps, int(position["num_steps"])
            behind = have > want
            if have < want:
                raise LedgerStateError(
                    f"the ledger holds {have} steps but the checkpoint was taken after {want}: "
                    "continue the run's own ledger file (PrivacyLedger(path, resume=True) with "
                    f"path {position.get('path')!r}); a ledger missing steps would understate ε"
                )
            if have > want:
                logger.warning(
                    "the ledger holds %d steps recorded after this checkpoint (training went on "
                    "past it before stopping); they stay in the ledger and count towards "
                    "epsilon, because their noise was drawn and their results may have been seen",
                    have - want,
                )
        if self._distributed:  # only rank 0 holds the ledger; the ranks must sample alike
            (flag,) = broadcast_tensors(
                [torch.tensor([int(behind)], dtype=torch.int64, device=self._device)],
                process_group=self._group,
            )
            behind = bool(flag.item())
        if (self._stream is None) != (state_dict.get("correlated") is None):
            raise InvalidParameterError(
                "state_dict",
                "a checkpoint with "
                + ("independent" if self._stream is not None else "correlated")
                + " noise",
                "a checkpoint of an optimizer with the same noise= (independent or correlated)",
            )
        if self._stream is not None:
            # the checkpoint's cyclic scheme (its seed) takes over, checked before anything
            # changes: a make_private(seed=None) run drew a partition of its own
            scheme = self._sampler.scheme_of_state(state_dict.get("sampler"))
            self._stream.load_state_dict(
                state_dict["correlated"], ledger=self._ledger, scheme=scheme
            )
        self._opt.load_state_dict(state_dict["optimizer"])
        if behind:
            logger.warning(
                "reseeding the noise generator and the batch sampler from OS entropy: "
                "restoring the checkpoint's generator states would repeat the noise and the "
                "samples of the steps recorded after it"
            )
            self._generator.seed()
            if self._sampler is not None:
                self._sampler.reseed(
                    _common_seed(self._group) if self._distributed else secrets.randbits(62)
                )
        else:
            self._generator.set_state(state_dict["noise_generator_state"])
            if self._sampler is not None and state_dict.get("sampler") is not None:
                self._sampler.load_state_dict(state_dict["sampler"])
        self._steps_taken = int(state_dict["steps_taken"])
        self._discard_pending()
        self._reset()
