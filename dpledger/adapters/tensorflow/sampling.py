"""Samplers of records for ``tf.data``: Poisson, fixed-size, truncated Poisson, balls-in-bins
and shuffled batches.

Each sampler is a transformation of a population of n records into a dataset of batches
(:meth:`RecordedDatasetSampler.sample`), and says which :class:`~dpledger.ledger.SamplingEvent` each
of those batches is (:meth:`RecordedDatasetSampler.event_for_step`), so that the training step that
consumes a batch records exactly the scheme that drew it (docs/architecture.md, "Soundness rules",
rule 6). The samplers do not write to a ledger themselves. What a scheme is (its checked parameters,
q, denominator, epoch layout and events) is described without TensorFlow by the sampler's
:attr:`RecordedDatasetSampler.scheme` (:mod:`dpledger.sampling`); the samplers here only draw the
index batches.

The schemes (one iteration over a sampler's dataset is one *epoch* of ``steps_per_epoch``
batches):

* :class:`PoissonDatasetSampler`: each step, each record is in the batch independently with
  probability q (McMahan & Andrew, Sec. 2). Batch sizes are Binomial(n, q), possibly 0.
* :class:`FixedSizeDatasetSampler`: each step, b distinct records drawn uniformly without
  replacement, independently of the other steps.
* :class:`TruncatedPoissonDatasetSampler`: a Poisson draw of rate q, cut to a uniformly random
  subset of ``max_batch_size`` records when it is larger.
* :class:`BallsInBinsDatasetSampler`: at the start of each epoch every record is put in one of k
  batches uniformly at random, independently; the epoch's steps are the k batches in order.
* :class:`ShuffleDatasetSampler`: at the start of each epoch a uniformly random permutation of
  the n records is cut into consecutive batches of b (the last one smaller unless ``drop_last``).
* :class:`CyclicDatasetSampler`: the records split once into ``period`` fixed groups visited in
  turn, whole or Poisson-sampled (:class:`~dpledger.sampling.CyclicScheme`): the batches of a
  correlated-noise release (``DPKerasModel(noise=spec)``), which records no per-step event.

The events of the epoch-based schemes (balls-in-bins, shuffle) carry ``epoch_start=True`` on the
first batch of each iteration: that step's draw made the epoch's allocation or permutation.

The samplers live in :mod:`~dpledger.adapters.tensorflow.sampler_base` (the base, its datasets and
the randomness), :mod:`~dpledger.adapters.tensorflow.stepwise_samplers` (Poisson, fixed size,
truncated Poisson) and :mod:`~dpledger.adapters.tensorflow.epoch_samplers` (balls-in-bins,
shuffle); this module gathers them.
"""

from dpledger.adapters.tensorflow.cyclic_sampler import CyclicDatasetSampler
from dpledger.adapters.tensorflow.epoch_samplers import (
    BallsInBinsDatasetSampler,
    ShuffleDatasetSampler,
)
from dpledger.adapters.tensorflow.sampler_base import RecordedDatasetSampler
from dpledger.adapters.tensorflow.stepwise_samplers import (
    FixedSizeDatasetSampler,
    PoissonDatasetSampler,
    TruncatedPoissonDatasetSampler,
)

__all__ = [
    "BallsInBinsDatasetSampler",
    "CyclicDatasetSampler",
    "FixedSizeDatasetSampler",
    "PoissonDatasetSampler",
    "RecordedDatasetSampler",
    "ShuffleDatasetSampler",
    "TruncatedPoissonDatasetSampler",
]
