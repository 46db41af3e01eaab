"""The exceptions dpledger raises.

Every error is a :class:`DPLedgerError`. Errors caused by a bad argument also subclass
:class:`ValueError`, so code that already catches ``ValueError`` keeps working. Messages name the
parameter, the value that was given and what would have been valid.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AccountingNumericalError",
    "ComputationBudgetError",
    "DPLedgerError",
    "InvalidParameterError",
    "LedgerError",
    "LedgerExistsError",
    "LedgerFileError",
    "LedgerLockedError",
    "LedgerStateError",
    "LedgerVerificationError",
    "NotALedgerError",
    "UnsupportedLedgerError",
    "describe_value",
    "format_bytes",
]


class DPLedgerError(Exception):
    """Root of every exception raised by dpledger."""


class InvalidParameterError(DPLedgerError, ValueError):
    """A parameter has a value outside its valid domain.

    Attributes:
        parameter: the name of the offending parameter, as the caller spelled it.
        value: the value that was rejected.
        expected: a short description of the valid values.
    """

    def __init__(self, parameter: str, value: Any, expected: str) -> None:
        self.parameter = parameter
        self.value = value
        self.expected = expected
        # describe_value: a value whose repr fails or runs to thousands of digits (an int past
        # Python's int-to-string limit) must not turn building this error into another error
        super().__init__(f"{parameter}={describe_value(value)} is invalid: expected {expected}")


class LedgerError(DPLedgerError):
    """A privacy ledger cannot do what was asked."""


class LedgerStateError(LedgerError, RuntimeError):
    """The ledger is in the wrong state for the call.

    Examples: a sum query recorded before any sampling event, or a record on a ledger that was
    closed or loaded read-only.
    """


class LedgerFileError(LedgerError):
    """A problem with a ledger file on disk."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.path = path
        super().__init__(message)


class NotALedgerError(LedgerFileError, ValueError):
    """The file is not a dpledger ledger (or a path is a directory)."""


class LedgerExistsError(LedgerFileError, FileExistsError):
    """A new ledger was asked for at a path where a file already exists."""


class LedgerLockedError(LedgerFileError):
    """Another writer holds the ledger file open for appending."""


class LedgerVerificationError(LedgerFileError):
    """A ledger file was altered after it was written.

    Attributes:
        line_number: 1-based number of the first line that fails verification.
        reason: what is wrong with that line.
    """

    def __init__(self, reason: str, *, line_number: int, path: str | None = None) -> None:
        self.line_number = line_number
        self.reason = reason
        where = f"{path}: " if path else ""
        super().__init__(f"{where}line {line_number}: {reason}", path=path)


class UnsupportedLedgerError(DPLedgerError, ValueError):
    """An accountant cannot analyse this ledger (an event kind, a neighboring relation, …)."""


def describe_value(value: Any) -> str:
    """``repr(value)``, except that it never fails and never prints thousands of digits.

    An integer too long for ``repr`` (Python limits int-to-string conversion to 4300 digits) or
    longer than 40 digits is described by its number of bits instead; any other value whose
    ``repr`` fails is described by its type.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 130:
        sign = "-" if value < 0 else ""
        return f"{sign}<an integer of {value.bit_length()} bits, about 2**{value.bit_length() - 1}>"
    try:
        return repr(value)
    except Exception:  # a repr that fails must not hide the real error
        return f"<a {type(value).__name__}>"


class ComputationBudgetError(DPLedgerError, ValueError):
    """An accountant refused a computation that would exceed its memory or time budget.

    Raised *before* the work starts, from an up-front estimate. The message names the setting
    that drives the cost, the estimate, the budget and what would make the computation feasible
    (a coarser discretisation, a larger budget, or another accountant).

    Attributes:
        parameter: the setting or input that drives the cost (e.g.
            ``"value_discretization_interval"``, ``"noise_multiplier"``).
        value: its value.
        estimated_bytes: the estimated peak memory of the computation.
        budget_bytes: the memory budget it was checked against.
        estimated_seconds: the estimated time (None when only memory was checked).
        budget_seconds: the time budget (None when only memory was checked).
        suggestion: what would make it feasible.
    """

    def __init__(
        self,
        *,
        parameter: str,
        value: Any,
        estimated_bytes: float,
        budget_bytes: float,
        suggestion: str,
        accountant: str = "",
        estimated_seconds: float | None = None,
        budget_seconds: float | None = None,
    ) -> None:
        self.parameter = parameter
        self.value = value
        self.estimated_bytes = estimated_bytes
        self.budget_bytes = budget_bytes
        self.estimated_seconds = estimated_seconds
        self.budget_seconds = budget_seconds
        self.suggestion = suggestion
        who = f"the {accountant} accountant" if accountant else "this computation"
        if estimated_seconds is not None and budget_seconds is not None:
            need = (
                f"about {estimated_seconds:.3g} s (time budget {budget_seconds:g} s, time_budget_s)"
            )
        else:
            need = (
                f"about {format_bytes(estimated_bytes)} (memory budget "
                f"{format_bytes(budget_bytes)}, memory_budget)"
            )
        super().__init__(
            f"{who} would need {need} with {parameter}={describe_value(value)}; {suggestion}"
        )


class AccountingNumericalError(DPLedgerError, ArithmeticError):
    """An accountant could not compute a trustworthy number for these inputs.

    Raised instead of a NaN, a negative ε or an untyped floating-point error (overflow, division
    by zero, …) when the inputs are legal but outside what the accountant's arithmetic handles.
    The message names the accountant, the inputs and suggests another accountant or setting.
    """


def format_bytes(n: float) -> str:
    """A byte count in binary units with three significant digits (``"35.5 PiB"``)."""
    if n != n:  # NaN
        return "an unknown amount"
    if n == float("inf"):
        return "unboundedly much memory"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024.0 or unit == "EiB":
            return f"{n:.3g} {unit}"
        n /= 1024.0
    return f"{n:.3g} EiB"  # pragma: no cover - the loop always returns


class MissingHeaderError(NotALedgerError):
    """A file holds no complete ledger header: it is empty, or its writer stopped in line 1.

    Such a file records nothing, not even the neighboring relation, so it is not a ledger that can
    be read or accounted (an accountant would report ε = 0 for it). Reopening it with
    ``PrivacyLedger(path, resume=True)`` starts it over with a new header.
    """


__all__ += ["MissingHeaderError"]


class SamplerMismatchError(DPLedgerError, RuntimeError):
    """A step's records were not drawn by the sampler whose parameters the ledger would record.

    The sampling event of a step says how its records were chosen (q and n of a Poisson sampler);
    a batch from another loader, or one cut or filtered after sampling, would be recorded with a
    guarantee it does not have. The step is refused before anything is recorded.
    """


__all__ += ["SamplerMismatchError"]


class UnsupportedSamplingError(UnsupportedLedgerError):
    """An accountant has no valid analysis for a sampling scheme (or unit) in the ledger.

    Raised before any computation, so that a run is never credited with another sampler's
    guarantee (e.g. shuffled batches accounted as Poisson).

    Attributes:
        accountant: the accountant's name.
        scheme: the value of the scheme it refused (``"shuffle"``, …), or None when the ledger
            mixes units of privacy.
    """

    def __init__(self, message: str, *, accountant: str, scheme: str | None) -> None:
        self.accountant = accountant
        self.scheme = scheme
        super().__init__(message)


__all__ += ["UnsupportedSamplingError"]


class DeltaTooLargeWarning(UserWarning):
    """δ is at least 1/n, the probability of one record in a population of n.

    A mechanism that publishes one record of the n, chosen at random, in the clear is
    (0, 1/n)-DP: a guarantee with δ ≥ 1/n allows every record to be leaked with some
    probability. The usual advice is δ ≪ 1/n, e.g. δ ≤ 1/(10n).

    Attributes:
        delta: the δ given.
        population_size: n, the number of records (or users) in the population.
    """

    def __init__(self, message: str, *, delta: float, population_size: int) -> None:
        self.delta = delta
        self.population_size = population_size
        super().__init__(message)


__all__ += ["DeltaTooLargeWarning"]


class RelationMismatchError(InvalidParameterError):
    """Two privacy parameters stated under different neighbouring relations were compared.

    An ε under replace-one and an ε under add/remove (or zero-out) bound different things, so
    neither comparison between them says anything; the comparison is refused instead.
    """


__all__ += ["RelationMismatchError"]


# ---- the framework adapters' errors: one set for PyTorch and Keras ("layer" is a Keras layer or a
# PyTorch module; neither framework is imported here)


class UnsupportedLayerError(DPLedgerError, ValueError):
    """A layer (a Keras layer or a PyTorch module) cannot be given correct per-example gradients
    as it is configured.

    Examples: ``nn.Embedding(scale_grad_by_freq=True)`` (the scale depends on the whole batch), a
    Keras layer with a regulariser, a recurrent layer with ``recurrent_dropout``, or a PyTorch
    module with randomness (dropout) inside a part of the model whose forward the engine has to
    recompute per example.

    Attributes:
        layer_name: the layer's name (Keras name, or the module's qualified name), or None.
        layer_type: its class name, or None.
    """

    def __init__(
        self, message: str, *, layer_name: str | None = None, layer_type: str | None = None
    ) -> None:
        self.layer_name = layer_name
        self.layer_type = layer_type
        super().__init__(message)


class RecordMixingLayerError(UnsupportedLayerError):
    """A layer combines several records of the batch into one output.

    Batch normalisation in training mode normalises each example with the mean and variance of
    the whole batch, so one record's gradient depends on every other record of the batch and
    clipping each per-example gradient no longer bounds any record's influence on the update.
    Use group or layer normalisation instead, or freeze the layer (PyTorch: ``module.eval()``
    with running statistics; Keras 3: ``layer.trainable = False``, under which batch
    normalisation runs in inference mode with its moving statistics).
    """


class RecordDependenceError(RecordMixingLayerError):
    """The record-independence probe saw one record move another record's result.

    Raised by both adapters' probes (:mod:`dpledger.adapters.torch.record_probe`,
    :mod:`dpledger.adapters.tensorflow.record_probe`) before the first recorded step, when
    changing record 0 of a small probe batch changes another record's layer output or
    per-example gradient.

    Attributes:
        layer_name: the name of the first layer whose output mixes records (``""`` for the
            PyTorch model itself), or None when no layer output mixes and only the per-example
            gradients move (a backward that mixes records).
        layer_type: that layer's class name, or None.
        parameters: the parameters whose per-example gradients moved (empty when the forward
            check found the layer first).
    """

    def __init__(
        self,
        message: str,
        *,
        layer_name: str | None,
        layer_type: str | None,
        parameters: tuple[str, ...] = (),
    ) -> None:
        self.parameters = parameters
        super().__init__(message, layer_name=layer_name, layer_type=layer_type)


class RecordProbeError(DPLedgerError, RuntimeError):
    """The record-independence probe could not run the model on its probe batch.

    Raised by both adapters' probes (:mod:`dpledger.adapters.torch.record_probe`,
    :mod:`dpledger.adapters.tensorflow.record_probe`) when the model's forward (or, in Keras, the
    loss) fails on the probe's few records: a forward that needs the whole batch (a fixed batch
    size in a reshape), or one that fails on the probe's second batch, whose record 0 is a copy
    of another record of the batch. The message says which run failed and why; the original
    exception is chained. ``check_record_independence=False`` switches the probe off (then make
    sure that no layer mixes the records of a batch: docs/guarantees.md).

    Attributes:
        run: ``"original"`` (the first records of the batch as given) or ``"changed"`` (record 0
            replaced).
    """

    def __init__(self, message: str, *, run: str) -> None:
        self.run = run
        super().__init__(message)


def record_probe_failure(exc: BaseException, *, m: int, run: str, other: int | None) -> str:
    """The message of a :class:`RecordProbeError` (one text for both adapters).

    Args:
        exc: what the model's forward raised.
        m: how many records the probe batch held.
        run: ``"original"`` or ``"changed"``.
        other: the record whose copy replaced record 0 in the changed run (None: record 0's
            own values permuted).
    """
    if run == "original":
        batch = f"the first {m} records of the batch, unchanged"
    elif other is None:
        batch = f"the first {m} records of the batch, record 0's values permuted among themselves"
    else:
        batch = f"the first {m} records of the batch, record 0 replaced by a copy of record {other}"
    return (
        f"the model's forward raised {type(exc).__name__}: {exc} -- inside dpledger's "
        f"record-independence probe, which runs it before the first step on {batch}, to check "
        "that no record changes another record's result. A forward that needs the whole batch "
        "(a fixed batch size) or fails on these records cannot be probed: pass "
        "check_record_independence=False, and make sure no layer mixes the records of a batch "
        "(docs/guarantees.md, 'What the record-independence probe checks')"
    )


class UnsupportedParameterUseError(DPLedgerError, ValueError):
    """A parameter's gradient does not come (only) from forward calls the engine observed.

    Raised when a trainable parameter receives gradient from a computation outside the forward of
    the module it belongs to (for example ``F.linear(h, self.embedding.weight)`` written in a
    parent module), or when the engine's sum of per-example gradients disagrees with autograd's
    batch gradient (which is also what a wrong ``loss_reduction`` looks like).
    """


class PerExampleLossError(DPLedgerError, ValueError):
    """A loss does not give one value per example.

    Per-example clipping needs the loss of each record separately: a Keras loss with
    ``reduction="none"`` (or ``None``), or a callable ``loss(y_true, y_pred)`` returning a tensor
    whose leading axis is the batch.
    """


class EngineStateError(DPLedgerError, RuntimeError):
    """The engine was asked for something before the step reached the point that provides it.

    Example: per-example norms asked for before ``loss.backward()`` ran on the last forward.
    """


class NoiseStreamEndError(DPLedgerError, RuntimeError):
    """A step beyond the T steps of a correlated-noise release was asked for.

    The ledger's ``correlated_release`` stands for exactly T steps of one stream
    (``docs/correlated-noise.md``); a step T + 1 would release noise the event does not cover, so
    it is refused before anything is computed or recorded. Train a longer stream (a new
    ``CorrelatedNoiseSpec``, a new release).
    """


class LedgerNotAttachedError(DPLedgerError, RuntimeError):
    """A :class:`~dpledger.adapters.tensorflow.DPKerasModel` loaded with
    ``keras.models.load_model`` was asked to train before it was given a ledger.

    The ledger is a file the user owns, not part of the saved model: a loaded model records
    nothing until :meth:`~dpledger.adapters.tensorflow.DPKerasModel.attach_ledger` gives it one
    (``PrivacyLedger(path, resume=True)`` continues the saved run's file; a new ledger starts a
    new account, which then does not hold the steps taken before the save).
    """


class NotCompiledError(DPLedgerError, ValueError):
    """A :class:`~dpledger.adapters.tensorflow.DPKerasModel` was trained before it was compiled.

    Compiling the Keras model inside it does not compile the wrapper: the wrapper's steps use
    the wrapper's own optimizer and loss.
    """


class UnrecordedTrainingWarning(UserWarning):
    """A model wrapped by :class:`~dpledger.adapters.tensorflow.DPKerasModel` is trained
    directly (its own ``fit``, ``train_on_batch`` or ``train_step``): those steps are not
    private and are not recorded in the wrapper's ledger."""


class LossReductionWarning(UserWarning):
    """The loss's own reduction contradicts the declared ``loss_reduction`` (PyTorch).

    Raised as a warning on the first step, by
    :meth:`~dpledger.adapters.torch.engine.PerExampleGradientEngine.backward`
    (``optimizer.backward(loss)``) or from inside a plain ``loss.backward()``
    (:mod:`~dpledger.adapters.torch.loss_reduction`), when the loss is the direct output of a
    PyTorch loss with a ``reduction`` (``cross_entropy``, ``nll_loss``, ``mse_loss``,
    ``binary_cross_entropy``, …) whose value differs from the declaration. The privacy
    guarantee holds either way (the clipped contributions stay bounded by the clip norm), but
    every per-example gradient is scaled by B or 1/B before clipping, so clipping acts at another
    effective norm.

    Attributes:
        declared: the declared ``loss_reduction``.
        found: the reduction of the loss (``"mean"`` or ``"sum"``).
        loss_function: the autograd node of the loss (e.g. ``"NllLossBackward0"``).
    """

    def __init__(self, message: str, *, declared: str, found: str, loss_function: str) -> None:
        self.declared = declared
        self.found = found
        self.loss_function = loss_function
        super().__init__(message)


__all__ += [
    "EngineStateError",
    "LedgerNotAttachedError",
    "LossReductionWarning",
    "NoiseStreamEndError",
    "PerExampleLossError",
    "RecordDependenceError",
    "RecordMixingLayerError",
    "UnrecordedTrainingWarning",
    "UnsupportedLayerError",
    "UnsupportedParameterUseError",
]


class UpdateOverBoundError(InvalidParameterError):
    """A client's model update (L2 ``norm``) is longer than the ``bound`` S it was to be clipped
    to on the ``client`` (a Flower node id); the round is refused before anything is recorded."""

    def __init__(self, *, client: int, norm: float, bound: float) -> None:
        self.client, self.norm, self.bound = client, norm, bound
        value, valid = (
            f"an update of L2 norm {norm!r} from client {client}",
            f"norm <= S = {bound!r}",
        )
        super().__init__("update", value, valid)


__all__ += ["UpdateOverBoundError"]
