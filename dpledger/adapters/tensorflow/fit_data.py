"""The data :class:`~dpledger.adapters.tensorflow.DPKerasModel`'s ``fit`` accepts: batches
drawn by the recorded sampler (docs/architecture.md, "Soundness rules", rule 6), or arrays that
it then samples itself with the recorded Poisson rate; and the model checks made before any
step (regularisers, which are not per-example terms).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from dpledger.adapters.tensorflow.sampling import PoissonDatasetSampler
from dpledger.errors import InvalidParameterError, SamplerMismatchError, UnsupportedLayerError
from dpledger.ledger import SamplingScheme
from dpledger.mechanisms.step import StepEvents
from dpledger.validation import check_positive_int

__all__ = [
    "BATCH_SOURCES",
    "check_sampled_batches",
    "poisson_batches",
    "refuse_regularizers",
]

# logged under the model's module, whose fit this serves
_log = logging.getLogger("dpledger.adapters.tensorflow.keras_model")

BATCH_SOURCES = (tf.data.Dataset, keras.utils.PyDataset, Iterator)
"""What ``fit`` takes as batches already sampled (anything else is arrays to sample)."""


def refuse_regularizers(model: keras.Model) -> None:
    """Refuse a model with a weight or activity regulariser (not a per-example term).

    Raises:
        UnsupportedLayerError: naming the layer and the fix.
    """
    for layer in model._flatten_layers(include_self=True, recursive=True):
        for attribute in ("activity_regularizer", "kernel_regularizer", "bias_regularizer"):
            if getattr(layer, attribute, None) is not None:
                raise UnsupportedLayerError(
                    f"layer {layer.name!r} has a {attribute}; its loss is not a per-example term "
                    "and is not part of the privatised gradient. Remove it and use the "
                    "optimizer's weight_decay (e.g. keras.optimizers.AdamW or "
                    "SGD(weight_decay=...)), which is data-independent and costs no privacy.",
                    layer_name=layer.name,
                    layer_type=type(layer).__name__,
                )


def check_sampled_batches(x: Any, batch_size: Any, *, events: StepEvents, sampler: Any) -> None:
    """Refuse data that is not the recorded sampler's batches: a ``batch_size``, arrays, or a
    dataset that the model's sampler did not draw.

    Raises:
        InvalidParameterError: ``batch_size`` given, or ``x`` not a dataset of batches.
        SamplerMismatchError: the model has a sampler and ``x`` is not its draws.
    """
    if batch_size is not None:
        raise InvalidParameterError(
            "batch_size",
            batch_size,
            "None: the batches come from the sampler (sampler.sample((x, y)) of a "
            "PoissonDatasetSampler, ShuffleDatasetSampler, …), which decides their size",
        )
    if not isinstance(x, BATCH_SOURCES):
        raise InvalidParameterError(
            "x",
            f"<{type(x).__name__}>",
            "a dataset of sampled batches (sampler.sample((x, y))), not arrays: Keras would "
            "shuffle arrays into fixed-size batches, whose sampling is not the one recorded "
            "in the ledger (for shuffled batches, ShuffleDatasetSampler records them as such)",
        )
    drew = getattr(sampler, "drew", None)
    if drew is not None and not drew(x):
        raise SamplerMismatchError(
            "fit() was given batches that the recorded sampler did not draw: "
            f"{sampler!r} records its sampling event "
            f"({events.event.describe()}) with every step, so the data must be "
            "sampler.sample((x, y)) itself, optionally followed by .prefetch() or "
            ".with_options(); a dataset shuffled and batched (or batched, filtered, mapped, "
            "taken, cached …) after or instead of sampling has other batches. For shuffled "
            "fixed-size batches like dataset.shuffle(n).batch(b), use "
            "ShuffleDatasetSampler(population_size=n, batch_size=b), recorded truthfully as "
            "shuffle(b, n) (analysed under neighboring='replace_one', without amplification); "
            "for amplification by sampling, PoissonDatasetSampler. Nothing was recorded"
        )


def poisson_batches(
    x: Any, y: Any, batch_size: Any, kwargs: dict[str, Any], *, events: StepEvents, sampler: Any
) -> tf.data.Dataset:
    """Poisson batches of the arrays ``x`` (and ``y``, ``sample_weight`` popped from
    ``kwargs``) drawn with the recorded q: by ``sampler`` when it is a
    :class:`~dpledger.adapters.tensorflow.PoissonDatasetSampler`, else by a new one.

    Raises:
        InvalidParameterError: naming what does not match the recorded sampling.
    """
    event = events.event
    if event.scheme is not SamplingScheme.POISSON or event.unit.value != "record":
        raise InvalidParameterError(
            "x",
            f"<{type(x).__name__}>",
            "a dataset of sampled batches (sampler.sample((x, y))), not arrays: Keras would "
            "shuffle arrays into fixed-size batches, whose sampling is not the one recorded "
            f"in the ledger ({event.describe()}; for shuffled batches, ShuffleDatasetSampler "
            "records them as such)",
        )
    leaves = tf.nest.flatten(x)
    shape = getattr(leaves[0], "shape", None) if leaves else None
    if shape is None or len(shape) == 0 or shape[0] is None:
        raise InvalidParameterError(
            "x", f"<{type(x).__name__}>", "arrays or tensors with a leading record axis"
        )
    n, q = int(shape[0]), event.sampling_probability
    if n != event.population_size:
        raise InvalidParameterError(
            "x",
            f"<{n} records>",
            f"the population of population_size={event.population_size} records that the "
            "ledger records every step is sampled from",
        )
    if batch_size is not None:
        b = check_positive_int("batch_size", batch_size)
        if b / n != q:
            raise InvalidParameterError(
                "batch_size",
                batch_size,
                f"None, or a batch size with batch_size / len(x) = q = {q!r}, the "
                f"sampling_probability the ledger records (batch_size / len(x) = {b}/{n} = "
                f"{b / n!r}); build the model with sampling_probability=batch_size / len(x) "
                "to train at another rate",
            )
    if not isinstance(sampler, PoissonDatasetSampler):
        sampler = PoissonDatasetSampler(population_size=n, sampling_probability=q)
    data = x if y is None else (x, y)
    if kwargs.get("sample_weight") is not None:
        data = (x, y, kwargs.pop("sample_weight"))
    _log.info(
        "fit on arrays: Poisson batches with q = %s = %r (each of the %d records joins "
        "each batch with probability q; %d batches per epoch, %.4g records expected each)",
        "the model's sampling_probability" if batch_size is None else f"{b} / {n}",
        q,
        n,
        sampler.steps_per_epoch,
        q * n,
    )
    return sampler.sample(data)
