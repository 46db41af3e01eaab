"""The properties a sampler shows of its scheme, written once for every framework.

A sampler of a framework adapter (the PyTorch batch samplers, the ``tf.data`` samplers) holds
its scheme (:mod:`dpledger.sampling.schemes`) as ``self._scheme`` and shows the scheme's
parameters (q, b, n/k, ``drop_last`` …) as its own properties. :func:`scheme_property` makes such
a property from the scheme's, with the scheme's docstring, so that what a parameter means is
written in one place whatever the framework.

Example:
    >>> from dpledger.sampling import ShuffleScheme
    >>> class Sampler:
    ...     def __init__(self) -> None:
    ...         self._scheme = ShuffleScheme(population_size=10, batch_size=4)
    ...     batch_size = scheme_property(ShuffleScheme.batch_size)
    >>> Sampler().batch_size
    4
"""

from __future__ import annotations

from typing import Any

__all__ = ["scheme_property"]


def scheme_property(prop: property) -> property:
    """A read-only property that reads ``prop`` of the instance's scheme (``self._scheme``).

    Args:
        prop: a property of a :class:`~dpledger.sampling.schemes.BatchScheme` class, e.g.
            ``PoissonScheme.sampling_probability``.

    Returns:
        A property with ``prop``'s docstring whose value is ``prop`` of ``self._scheme``.

    Raises:
        TypeError: ``prop`` is not a readable property.
    """
    if not isinstance(prop, property) or prop.fget is None:
        raise TypeError(f"scheme_property needs a readable property, not {prop!r}")
    getter = prop.fget

    def get(self: Any) -> Any:
        return getter(self._scheme)

    return property(get, doc=prop.__doc__)
