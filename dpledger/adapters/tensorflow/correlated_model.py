"""``DPKerasModel(..., noise=spec)``: the model-level set-up of a correlated-noise release
(``docs/correlated-noise.md``, "Keras"): the checks at construction, the data ``fit`` accepts,
and what a saved model keeps of the release.

The soundness ties (``docs/architecture.md``, "Soundness rules", rules 1 and 6):

* the batches come from the model's :class:`~dpledger.adapters.tensorflow.CyclicDatasetSampler`,
  whose core :class:`~dpledger.sampling.CyclicScheme` gives the participation schema and q the
  release records; ``fit`` on arrays draws from it, and a dataset it did not draw is refused
  before anything is recorded;
* the release is recorded once, at the first executed step, after that step's sensitivity check
  and before its noisy output (:mod:`~dpledger.adapters.tensorflow.correlated_step`);
* a step beyond T is refused (:class:`~dpledger.errors.NoiseStreamEndError`);
* every step records ``stream_step t`` after the release, before its noisy output;
* a saved model keeps the spec, the sampler's parameters and the noise generator's state; once
  loaded it trains only after ``attach_ledger`` gives it the ledger that holds its release (or,
  if it never trained, any ledger) with exactly the saved stream's steps recorded, and continues
  the stream where it was saved — never recording the release twice nor restarting the stream,
  and never continuing from a save older than the ledger's progress
  (:class:`~dpledger.ledger.correlated.NoiseStreamRollbackError`: that would reuse noise).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from typing import Any

import attrs
import tensorflow as tf

from dpledger.adapters.tensorflow.correlated_step import CorrelatedDatasetStream
from dpledger.adapters.tensorflow.cyclic_sampler import CyclicDatasetSampler
from dpledger.adapters.tensorflow.fit_data import BATCH_SOURCES
from dpledger.errors import InvalidParameterError, NoiseStreamEndError, SamplerMismatchError
from dpledger.ledger import NeighboringRelation, PrivacyLedger
from dpledger.ledger.intent import INTENT_KEY, note_intent, run_intent
from dpledger.mechanisms import DPConfig
from dpledger.mechanisms.construction_checks import check_ledger
from dpledger.mechanisms.correlated import CorrelatedNoiseSpec
from dpledger.mechanisms.correlated.stream import (
    check_noise,
    check_one_group,
    state_from_json,
    state_to_json,
)
from dpledger.mechanisms.gradient_queries import GradientQueries

__all__ = [
    "attach_release",
    "correlated_batches",
    "correlated_from_json",
    "correlated_to_json",
    "fit_window",
    "ledger_for_release",
    "no_sampling_event",
    "refuse_query_changes",
    "stream_of",
]


def stream_of(
    noise: Any,
    sampler: Any,
    queries: GradientQueries,
    model: Any,
    config: DPConfig | None,
    generator: Any,
    seed: int | None,
    bias_callback: Any,
    *,
    gated: bool = False,
) -> CorrelatedDatasetStream | None:
    """The release's stream for ``noise=spec`` (None for ``noise="independent"``), after the
    checks that tie it to the sampler.

    Args:
        noise: ``"independent"`` or a spec.
        sampler: the model's sampler.
        queries: the model's queries (one group, no scales).
        model: the wrapped Keras model (d = its number of trainable parameters).
        config: the model's DPConfig (its noise multiplier z; σ = z·S).
        generator: must be None (the core generator draws the noise).
        seed: the seed of the core noise generator (None: OS entropy).
        bias_callback: must be None.
        gated: steps only inside :func:`fit_window` (``DPKerasModel``).

    Raises:
        InvalidParameterError: ``noise`` is neither ``"independent"`` nor a
            :class:`~dpledger.mechanisms.correlated.CorrelatedNoiseSpec`; the sampler is not a
            :class:`CyclicDatasetSampler` drawing what the spec asks for; several groups or scales;
            a noise ``generator`` or a ``bias_callback`` (not supported with correlated noise).
    """
    spec = check_noise(noise)
    if spec is None:
        return None
    if not isinstance(sampler, CyclicDatasetSampler) or not noise.matches(sampler.cyclic_scheme):
        raise InvalidParameterError(
            "sampler",
            sampler,
            f"a CyclicDatasetSampler drawing what noise={noise.describe()} asks for: "
            f"CyclicDatasetSampler(population_size=n, period={noise.period}, "
            f"num_steps={noise.num_steps}, sampling_probability="
            f"{noise.sampling_probability if noise.amplified else None})",
        )
    if generator is not None:
        raise InvalidParameterError(
            "generator",
            generator,
            "None with correlated noise: its Gaussian draws come from the core float64 "
            "generator, seeded by seed=",
        )
    if bias_callback is not None:
        raise InvalidParameterError("bias_callback", bias_callback, "None with correlated noise")
    if config is None:
        raise InvalidParameterError(
            "queries", queries, "None with correlated noise: give l2_norm_bound, noise_multiplier"
        )
    bound = check_one_group(queries)
    dim = sum(int(tf.size(v)) for v in model.trainable_variables)
    return CorrelatedDatasetStream(
        spec,
        sampler,
        l2_norm_bound=bound,
        noise_multiplier=config.noise_multiplier,
        dim=dim,
        seed=secrets.randbits(63) if seed is None else seed,
        label=noise.describe(),
        gated=gated,
        fresh_seed=seed is None,
    )


@contextlib.contextmanager
def fit_window(stream: CorrelatedDatasetStream | None) -> Iterator[None]:
    """Open a gated stream for the steps of one ``fit`` whose data was checked."""
    if stream is None:
        yield
        return
    stream.open = True
    try:
        yield
    finally:
        stream.open = False


def no_sampling_event(stream: CorrelatedDatasetStream) -> InvalidParameterError:
    """The error for the sampling event of a model or ``PrivateGradients`` with correlated
    noise: its steps record no sampling event, one release stands for the stream."""
    return InvalidParameterError(
        "sampling_event",
        None,
        "a per-step sampling event, which only independent noise records: with noise= a "
        "correlated spec the ledger records one correlated-noise release for the whole stream "
        f"({stream.event.describe()}); see .sampling_probability and .population_size, or the "
        "release in ledger.correlated_releases",
    )


def refuse_query_changes(stream: CorrelatedDatasetStream | None, noise: Any) -> None:
    """Refuse ``update_queries`` on a model with a release (one S and σ for its stream).

    Raises:
        InvalidParameterError: ``stream`` is not None.
    """
    if stream is not None:
        raise InvalidParameterError(
            "noise",
            noise,
            "'independent' to change the queries: a correlated-noise release has one S and one "
            "σ for its whole stream",
        )


def ledger_for_release(
    ledger: PrivacyLedger | None, stream: CorrelatedDatasetStream, config: DPConfig | None
) -> PrivacyLedger:
    """The run's ledger: a new in-memory one holding the run's intent, or the one given (its
    missing intent is logged)."""
    intent = run_intent(
        framework="tensorflow",
        framework_version=tf.__version__,
        population_size=stream.sampler.population_size,
        noise_multiplier=stream.event.noise_stddev / stream.event.l2_norm_bound,
        delta=None if config is None else config.delta,
        sampling="cyclic",
        steps=stream.num_steps,
    )
    if ledger is None:
        return PrivacyLedger(
            neighboring=NeighboringRelation.ADD_REMOVE, metadata={INTENT_KEY: intent}
        )
    checked = check_ledger(ledger)
    assert checked is not None
    note_intent(checked, intent)
    return checked


def correlated_batches(
    x: Any, y: Any, batch_size: Any, kwargs: dict[str, Any], *, stream: CorrelatedDatasetStream
) -> Any:
    """The batches ``fit`` trains on: the sampler's draws of arrays ``x`` (and ``y``,
    ``sample_weight``), or ``x`` itself when it is a dataset the sampler made.

    Raises:
        NoiseStreamEndError: the epochs asked for go beyond the release's T steps.
        InvalidParameterError: ``batch_size`` given, ``steps_per_epoch`` other than the period.
        SamplerMismatchError: ``x`` is batches the sampler did not draw.
    """
    sampler = stream.sampler
    stream.check_open()
    if batch_size is not None:
        raise InvalidParameterError(
            "batch_size",
            batch_size,
            f"None: the batches are the groups of {sampler!r} (about "
            f"{sampler.average_denominator:.4g} records each)",
        )
    steps = kwargs.get("steps_per_epoch")
    if steps is not None and steps != sampler.period:
        raise InvalidParameterError(
            "steps_per_epoch", steps, f"None or the period {sampler.period} (one pass per epoch)"
        )
    passes = int(kwargs.get("epochs", 1)) - int(kwargs.get("initial_epoch", 0))
    left = stream.num_steps - stream.step
    if passes * sampler.period > left:
        raise NoiseStreamEndError(
            f"fit would take {passes} epochs of {sampler.period} steps, but the release has "
            f"{left} of its num_steps={stream.num_steps} steps left; nothing was trained"
        )
    if not isinstance(x, BATCH_SOURCES):
        data = x if y is None else (x, y)
        if kwargs.get("sample_weight") is not None:
            data = (x, y, kwargs.pop("sample_weight"))
        return sampler.sample(data)
    if y is not None or not sampler.drew(x):
        raise SamplerMismatchError(
            f"fit() was given batches that {sampler!r} did not draw: a correlated-noise release "
            "records the participation of its cyclic batches, so the data must be "
            "sampler.sample((x, y)) itself (optionally followed by .prefetch()), or the arrays "
            "(x, y) for the model to sample. Nothing was recorded"
        )
    return x


def correlated_to_json(
    spec: CorrelatedNoiseSpec, stream: CorrelatedDatasetStream
) -> dict[str, Any]:
    """What a saved model keeps of its release: the spec, the sampler's parameters, the clip
    bound and z, and the stream's state (generator, step, buffers, whether it was recorded)."""
    sampler = stream.sampler
    return {
        "spec": {
            k: (v.value if hasattr(v, "value") else v)
            for k, v in attrs.asdict(spec, recurse=False).items()
        },
        "sampler": {
            "population_size": sampler.population_size,
            "period": sampler.period,
            "num_steps": sampler.num_steps,
            "sampling_probability": sampler.sampling_probability,
            "seed": sampler.seed,
        },
        "state": state_to_json(stream.state_dict()),
    }


def correlated_from_json(
    values: dict[str, Any],
) -> tuple[CorrelatedNoiseSpec, CyclicDatasetSampler, Any]:
    """The spec, the sampler and the stream state :func:`correlated_to_json` saved."""
    spec = CorrelatedNoiseSpec(**values["spec"])
    sampler = CyclicDatasetSampler(**values["sampler"])
    return spec, sampler, state_from_json(values["state"])


def attach_release(
    stream: CorrelatedDatasetStream, ledger: PrivacyLedger, sampler: Any
) -> CyclicDatasetSampler:
    """Check the ledger and sampler given to a loaded model with a release; position the
    sampler at the stream's step.

    The saved stream's step p must be the ledger's progress q for the release: a save behind it
    (q > p, training went on past the save) would add the noise of steps p .. q − 1 again to
    other gradients. Everything is checked before anything changes.

    Raises:
        InvalidParameterError: the release was recorded but ``ledger`` does not hold it; the
            sampler draws other batches; the model was saved in the middle of a pass.
        NoiseStreamRollbackError: the ledger records more steps of the release than the saved
            stream took (load the latest save, or start a new release).
        LedgerStateError: the ledger records fewer steps of the release than the saved stream
            took (it is not the run's ledger).
    """
    if sampler is None:
        sampler = stream.sampler
    if (
        not isinstance(sampler, CyclicDatasetSampler)
        or sampler.cyclic_scheme != stream.sampler.cyclic_scheme
    ):
        raise InvalidParameterError(
            "sampler", sampler, f"None or a sampler drawing what {stream.sampler!r} draws"
        )
    if stream.step % sampler.period:
        raise InvalidParameterError(
            "model",
            f"saved at stream step {stream.step}",
            f"a model saved at the end of a pass (a multiple of period={sampler.period})",
        )
    stream.resume(ledger)
    sampler.seek(stream.step)
    sampler.drive()
    stream.sampler = sampler
    return sampler
