"""Sampling: the schemes that choose each step's records, without a framework.

Which records a step uses decides its privacy guarantee, so the ledger must record the scheme
that actually drew them (:class:`~dpledger.ledger.SamplingEvent`). This package holds what every
sampler of a scheme shares, whatever the framework:

* :mod:`~dpledger.sampling.schemes`: each scheme's parameters, q, average denominator, epoch
  and recorded event; :mod:`~dpledger.sampling.index_draws`: their index draws in NumPy.
* :mod:`~dpledger.sampling.validation`: the one copy of the sampling parameters' checks;
  :mod:`~dpledger.sampling.relations`: the neighbouring relation a ledger needs for a scheme.
* :mod:`~dpledger.sampling.draws`: ties each step to the draw whose event it records and refuses
  a step whose records the sampler did not draw (:class:`PendingDraws`).
* :mod:`~dpledger.sampling.cyclic` and :mod:`~dpledger.sampling.participation`: the cyclic
  groups and the participation schemas a correlated-noise release is analysed under.
* :class:`PoissonSampler`: Poisson samples of record indices for the framework-free mechanisms
  (``dpledger.mechanisms.sampled_step(ledger, sampler=...)``).

The PyTorch batch samplers (:mod:`dpledger.adapters.torch`) and the ``tf.data`` samplers
(:mod:`dpledger.adapters.tensorflow`) hold a scheme from here and only turn its index draws into
their framework's batches. This package imports neither framework, nor the mechanisms (which
import it).

Example:
    >>> from dpledger.sampling import ShuffleScheme
    >>> scheme = ShuffleScheme(population_size=10, batch_size=4)
    >>> scheme.steps_per_epoch, scheme.average_denominator
    (3, 4.0)
    >>> scheme.event_for_step(0).describe()
    'shuffle(b=4, n=10)'
    >>> scheme.event_for_step(0).epoch_start, scheme.event_for_step(1).epoch_start
    (True, False)
"""

from dpledger.sampling.cyclic import CyclicScheme
from dpledger.sampling.poisson import PoissonSampler
from dpledger.sampling.schemes import (
    BallsInBinsScheme,
    FixedSizeScheme,
    PoissonScheme,
    ShuffleScheme,
    TruncatedPoissonScheme,
    UserPoissonScheme,
)

__all__ = [
    "BallsInBinsScheme",
    "CyclicScheme",
    "FixedSizeScheme",
    "PoissonSampler",
    "PoissonScheme",
    "ShuffleScheme",
    "TruncatedPoissonScheme",
    "UserPoissonScheme",
]
