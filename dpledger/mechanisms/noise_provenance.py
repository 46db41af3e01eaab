"""The noise provenance of the NumPy entry point, ``sampled_step``
(:mod:`dpledger.ledger.provenance`): which generator its noise comes from and how it was seeded,
recorded as a note before the step's sampling event whenever it changes."""

from __future__ import annotations

from typing import Any

import numpy as np

from dpledger.ledger import PrivacyLedger
from dpledger.ledger.provenance import NoiseProvenance, note_noise_provenance
from dpledger.mechanisms.backend import ArrayBackend, NumpyBackend, resolve_backend

__all__ = ["note_numpy_provenance"]


def note_numpy_provenance(
    ledger: Any, backend: ArrayBackend | None, generator: Any, sampler: Any
) -> Any:
    """The step's generator (a fresh OS-seeded one for None with NumPy), after recording the
    NumPy entry point's noise provenance in ``ledger``; other backends' adapters record their
    own, and the secure backend (:class:`~dpledger.mechanisms.secure_noise.SecureNoiseBackend`)
    records its keystream."""
    be = resolve_backend(backend)
    if not isinstance(ledger, PrivacyLedger) or not isinstance(be, NumpyBackend):
        return generator
    stream = getattr(be, "stream", None)
    if stream is not None:  # secure noise: the backend's own keystream draws it
        note_noise_provenance(
            ledger,
            NoiseProvenance(
                entry_point="numpy.sampled_step",
                generator=f"chacha20 discrete Gaussian on the grid {be.grid!r}",  # type: ignore[attr-defined]
                seeding="caller_seed" if stream.keyed_by_caller else "os_entropy",
                sampler_seeding=None if sampler is None else "caller_generator",
                secure_sampler=True,
                state_location="the process's memory (the keystream's key)",
            ),
        )
        return generator
    seeding = "caller_generator"
    if generator is None:
        generator, seeding = np.random.default_rng(), "os_entropy"
    kind = type(getattr(generator, "bit_generator", generator)).__name__
    note_noise_provenance(
        ledger,
        NoiseProvenance(
            entry_point="numpy.sampled_step",
            generator=f"numpy.random.Generator({kind})",
            seeding=seeding,
            sampler_seeding=None if sampler is None else "caller_generator",
            state_location="the process's memory",
        ),
    )
    return generator
