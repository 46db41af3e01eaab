"""A PyTorch classifier's predictions into the model-calibration metrics (imports torch when
called).

:func:`predict_probabilities` runs a model on inputs in evaluation mode without gradients and
turns its outputs into class probabilities in float64:

* outputs of shape (n, M) with M ≥ 2 are logits: π_i = softmax(f(x_i));
* outputs of shape (n,) or (n, 1) are the logit of class 1 of a binary classifier:
  π_i = (1 − s_i, s_i) with s_i = sigmoid(f(x_i)).

:func:`model_calibration` passes them to
:func:`~dpledger.diagnostics.model_calibration.model_calibration_metrics` (NLL, ECE, MCE and the
reliability-diagram data of Bu et al., §6). The model's training mode is restored afterwards.
The softmax is taken in float64, so the rows sum to 1 within the metrics' tolerance even for
float32 or bfloat16 models.

The metrics are computed from whatever data they are given: evaluated on private data, they are
not differentially private.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dpledger.diagnostics.model_calibration import (
    Binning,
    ModelCalibrationMetrics,
    model_calibration_metrics,
)
from dpledger.errors import InvalidParameterError
from dpledger.validation import check_positive_int

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["model_calibration", "predict_probabilities"]


def _as_input(inputs: Any, reference: torch.Tensor | None) -> torch.Tensor:
    import torch

    if isinstance(inputs, torch.Tensor):
        x = inputs
    else:
        try:
            x = torch.as_tensor(np.asarray(inputs))
        except (TypeError, ValueError, RuntimeError):
            raise InvalidParameterError(
                "inputs", type(inputs).__name__, "a tensor or array with records along dim 0"
            ) from None
        if reference is not None:
            x = x.to(device=reference.device)
            if x.is_floating_point():
                x = x.to(dtype=reference.dtype)
    if x.ndim < 1 or x.shape[0] < 1:
        raise InvalidParameterError(
            "inputs", f"(shape {tuple(x.shape)})", "at least one record along dim 0"
        )
    return x


def predict_probabilities(
    model: nn.Module,
    inputs: Any,
    *,
    batch_size: int = 1024,
) -> np.ndarray:
    """Class probabilities (n, M) of ``model`` on ``inputs``, in float64 on the host.

    Args:
        model: a classifier returning logits (n, M), or (n,)/(n, 1) for a binary classifier.
        inputs: a tensor (used as it is) or an array (moved to the model's device; floating
            arrays cast to its parameters' dtype), records along dim 0.
        batch_size: records per forward pass.

    Returns:
        An (n, M) float64 array whose rows sum to 1 (M = 2 for a binary classifier).

    Raises:
        InvalidParameterError: a bad argument, or outputs of another shape.
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise InvalidParameterError("model", model, "a torch.nn.Module")
    size = check_positive_int("batch_size", batch_size)
    reference = next(model.parameters(), None)
    x = _as_input(inputs, reference)
    was_training = model.training
    model.eval()
    parts = []
    try:
        with torch.no_grad():
            for start in range(0, x.shape[0], size):
                chunk = x[start : start + size]
                out = model(chunk)
                rows = chunk.shape[0]
                if out.shape == (rows, 1):
                    out = out[:, 0]
                if not (out.ndim == 1 or (out.ndim == 2 and out.shape[1] >= 2)) or (
                    out.shape[0] != rows
                ):
                    raise InvalidParameterError(
                        "model",
                        f"<a model with outputs of shape {tuple(out.shape)} for {rows} records>",
                        "a classifier returning logits (n, M) with M >= 2, or (n,) or (n, 1) "
                        "for two classes",
                    )
                parts.append(out.to(torch.float64))
    finally:
        model.train(was_training)
    logits = torch.cat(parts)
    if logits.ndim == 1:
        s = torch.sigmoid(logits)
        probs = torch.stack([1.0 - s, s], dim=1)
    else:
        probs = torch.softmax(logits, dim=1)
    return probs.cpu().numpy()


def model_calibration(
    model: nn.Module,
    inputs: Any,
    labels: Any,
    *,
    num_bins: int = 15,
    binning: Binning | str = Binning.EQUAL_WIDTH,
    batch_size: int = 1024,
) -> ModelCalibrationMetrics:
    """Accuracy, NLL, ECE, MCE and reliability data of ``model`` on ``(inputs, labels)``.

    Equivalent to ``model_calibration_metrics(predict_probabilities(model, inputs), labels, ...)``.

    Args:
        model: the classifier (see :func:`predict_probabilities`).
        inputs: the records, along dim 0.
        labels: (n,) integer class labels (a tensor or an array).
        num_bins: B ≥ 1 (15 equal-width bins by default).
        binning: ``"equal_width"`` or ``"equal_mass"``.
        batch_size: records per forward pass.

    Returns:
        The :class:`~dpledger.diagnostics.model_calibration.ModelCalibrationMetrics`.
    """
    import torch

    probs = predict_probabilities(model, inputs, batch_size=batch_size)
    y = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else labels
    return model_calibration_metrics(probs, y, num_bins=num_bins, binning=binning)
