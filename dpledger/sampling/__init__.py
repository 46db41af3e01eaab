"""Sampling: the schemes that choose each step's records, without a framework.

Which records a step uses decides its privacy guarantee, so the ledger must record the scheme
that actually drew them (:class:`~dpledger.ledger.SamplingEvent`). This package holds what every
sampler of a scheme shares, whatever the framework:

* :mod:`~dpledger.sampling.schemes`: each scheme's validated parameters, its q, the denominator
  of DP-SGD's average, the batches of an epoch, the unit of privacy and the event a step records
  (:class:`PoissonScheme`, :class:`FixedSizeScheme`, :class:`TruncatedPoissonScheme`,
  :class:`BallsInBinsScheme`, :class:`ShuffleScheme`, :class:`UserPoissonScheme`).
* :mod:`~dpledger.sampling.validation`: the one copy of the sampling parameters' checks.
* :mod:`~dpledger.sampling.relations`: which neighbouring relation a ledger needs for a scheme.
* :mod:`~dpledger.sampling.draws`: the bookkeeping that ties each step to a draw of the sampler
  whose event it records, and refuses a step whose records the sampler did not draw
  (:class:`PendingDraws`).
* :mod:`~dpledger.sampling.cyclic`: :class:`CyclicScheme`, the fixed groups visited in turn
  (whole or Poisson-sampled) that a correlated-noise release is analysed under, and the
  participation schema it records.
* :mod:`~dpledger.sampling.index_draws`: every scheme's draw of record indices, on the host in
  NumPy (through :meth:`BatchScheme.draw` and :meth:`BatchScheme.draw_epoch`).
* :mod:`~dpledger.sampling.participation`: the participation schemas a correlated-noise release
  is analysed under.
* :class:`PoissonSampler`: Poisson samples of record indices with NumPy, for the framework-free
  mechanisms (``dpledger.mechanisms.sampled_step(ledger, sampler=...)``).

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
