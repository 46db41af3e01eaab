"""Checkpoints of :class:`~dpledger.adapters.torch.optimizer.DPOptimizer`.

:class:`OptimizerCheckpoint` holds ``state_dict`` and ``load_state_dict``: the wrapped
optimizer's state, the sampler's position and the ledger position, and the rules for resuming
against a ledger that holds as many, more, or fewer steps than the checkpoint; and the record of
where the run's noise comes from (:class:`~dpledger.ledger.provenance.NoiseProvenance`).

A default checkpoint carries neither the noise generator's state nor the batch sampler's: a
checkpoint pushed next to the weights must not hand out the noise of later (or, for an
invertible generator, earlier) steps or which records were drawn. A resume draws fresh states
from OS entropy, logs it, and records the new provenance. Bit-for-bit resume is an explicit
opt-in, :meth:`OptimizerCheckpoint.enable_bit_for_bit_resume`, which the ledger records
(``checkpoint: "included"``). Correlated noise is the exception: its checkpoint must carry the
stream's seed and state to continue the stream, and its provenance says so.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from typing import Any

import torch

from dpledger.adapters.torch.distributed import _common_seed, broadcast_tensors
from dpledger.errors import EngineStateError, InvalidParameterError, LedgerStateError
from dpledger.ledger.provenance import NoiseProvenance, note_noise_provenance

__all__ = ["OptimizerCheckpoint"]

logger = logging.getLogger("dpledger.adapters.torch.optimizer")

_STATE_VERSION = 1


class OptimizerCheckpoint:
    """``state_dict`` / ``load_state_dict`` of
    :class:`~dpledger.adapters.torch.optimizer.DPOptimizer` (a base class of it)."""

    _generator_states_in_checkpoints = False
    _noise_seeding = "os_entropy"

    def enable_bit_for_bit_resume(self) -> None:
        """Opt in to checkpoints that carry the noise and sampler generator states.

        A resume from such a checkpoint continues the same noise and the same batches, bit for
        bit (tests, debugging, research). Whoever holds the checkpoint can then regenerate the
        noise of the later steps (and, for torch's invertible generators, of earlier ones) and
        which records were drawn, so the ledger records the opt-in (a provenance note with
        ``checkpoint: "included"``) and ``dpledger epsilon`` and ``report`` flag it.
        """
        self._generator_states_in_checkpoints = True
        self._note_provenance()

    def _note_provenance(self) -> None:
        """Record where the noise comes from in the ledger (rank 0's; a note, once per change)."""
        stream = getattr(self, "_stream", None)
        if stream is not None:
            record = NoiseProvenance(
                entry_point="torch.DPOptimizer(correlated)",
                generator="numpy.random.Generator(PCG64)",
                seeding="os_entropy" if stream.fresh_seed else "caller_seed",
                sampler_seeding=getattr(self._sampler, "seeding", None),
                state_location="the training process's memory (rank 0) and every checkpoint",
                checkpoint="included",  # the stream's seed and state continue the stream
            )
        elif getattr(self._noise_source, "recorded_bound", None) is not None:
            source = self._noise_source
            record = NoiseProvenance(
                entry_point="torch.DPOptimizer",
                generator=f"chacha20 discrete Gaussian on the grid {source.grid!r}, host-drawn",
                seeding="caller_seed" if source.stream.keyed_by_caller else "os_entropy",
                sampler_seeding=getattr(self._sampler, "seeding", None),
                secure_sampler=True,
                state_location="the training process's memory (the keystream's key, rank 0)",
                checkpoint="excluded",  # a ChaCha20Stream is never saved
            )
        else:
            where = "rank 0's" if self._distributed else "the training process's"
            record = NoiseProvenance(
                entry_point="torch.DPOptimizer",
                generator=f"torch.Generator({self._device.type})",
                seeding=self._noise_seeding,
                sampler_seeding=getattr(self._sampler, "seeding", None),
                state_location=f"{where} memory ({self._device.type})",
                checkpoint="included" if self._generator_states_in_checkpoints else "excluded",
            )
        note_noise_provenance(self._ledger, record)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state with the sampler's and the ledger's positions, to be
        saved together with the model's ``state_dict()``.

        No generator state unless :meth:`enable_bit_for_bit_resume` was called
        (``noise_generator_state`` is then the noise generator's, ``sampler`` the sampler's
        with its generator). The ledger is flushed first, so that the ledger file holds at
        least every step this checkpoint counts.
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
        keep = self._generator_states_in_checkpoints
        if self._sampler is None:
            sampler = None
        elif self._stream is not None:  # the cyclic scheme: no generator, the stream's batches
            sampler = self._sampler.state_dict()
        else:
            sampler = self._sampler.state_dict(include_generator_state=keep)
        return {
            "version": _STATE_VERSION,
            "optimizer": self._opt.state_dict(),
            "noise_generator_state": self._generator.get_state() if keep else None,
            "sampler": sampler,
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
        saved = state_dict.get("noise_generator_state")
        if behind or (saved is None and self._stream is None):
            if behind:
                logger.warning(
                    "reseeding the noise generator and the batch sampler from OS entropy: "
                    "restoring the checkpoint's generator states would repeat the noise and the "
                    "samples of the steps recorded after it"
                )
            else:
                logger.info(
                    "the checkpoint holds no generator states (the default): the noise "
                    "generator and the batch sampler continue from fresh states drawn from OS "
                    "entropy (enable_bit_for_bit_resume() before saving keeps them)"
                )
            self._generator.seed()
            self._noise_seeding = "os_entropy"
            if self._sampler is not None and self._stream is None:
                self._sampler.reseed(
                    _common_seed(self._group) if self._distributed else secrets.randbits(62)
                )
                self._sampler._seeding = "os_entropy"
        else:
            if saved is not None:
                self._generator.set_state(saved)
                self._generator_states_in_checkpoints = True
            if self._sampler is not None and state_dict.get("sampler") is not None:
                self._sampler.load_state_dict(state_dict["sampler"])
        self._note_provenance()
        self._steps_taken = int(state_dict["steps_taken"])
        self._discard_pending()
        self._reset()
