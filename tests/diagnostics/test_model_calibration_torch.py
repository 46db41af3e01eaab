"""A PyTorch classifier's predictions into calibration metrics, on models with known outputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dpledger.diagnostics.model_calibration import model_calibration_metrics  # noqa: E402
from dpledger.diagnostics.model_calibration_torch import (  # noqa: E402
    model_calibration,
    predict_probabilities,
)
from dpledger.errors import InvalidParameterError  # noqa: E402

# A tiny two-class classifier with known confidences: 0.95 (right), 0.85 (wrong), 0.75 (right),
# 0.65 (right). Record i is the one-hot vector e_i and the model is linear without bias with
# weight column i = log π_i, so its logits are log π_i and softmax gives π_i back.
PROBS = np.array([[0.95, 0.05], [0.85, 0.15], [0.25, 0.75], [0.35, 0.65]])
LABELS = np.array([0, 1, 1, 1])


def known_classifier(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    model = torch.nn.Linear(4, 2, bias=False).to(dtype)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(np.log(PROBS).T, dtype=dtype))
    return model


def records(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.eye(4, dtype=dtype)


def test_probabilities_of_a_model_with_known_outputs():
    probs = predict_probabilities(known_classifier(), records())
    assert probs.dtype == np.float64
    np.testing.assert_allclose(probs, PROBS, rtol=1e-12)


def test_metrics_by_hand():
    m = model_calibration(known_classifier(), records(), LABELS, num_bins=10)
    assert m.accuracy == 0.75
    # One example per bin: gaps |1 − .95|, |0 − .85|, |1 − .75|, |1 − .65|.
    assert m.ece == pytest.approx((0.05 + 0.85 + 0.25 + 0.35) / 4)
    assert m.mce == pytest.approx(0.85)
    assert m.nll == pytest.approx(
        -(math.log(0.95) + math.log(0.15) + math.log(0.75) + math.log(0.65)) / 4
    )
    assert m.reliability.count.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]


def test_default_is_fifteen_equal_width_bins_and_labels_may_be_a_tensor():
    m = model_calibration(known_classifier(), records(), torch.tensor(LABELS))
    reference = model_calibration_metrics(PROBS, LABELS, num_bins=15, binning="equal_width")
    assert len(m.reliability.count) == 15
    assert m.ece == pytest.approx(reference.ece, rel=1e-12)
    assert m.mce == pytest.approx(reference.mce, rel=1e-12)
    np.testing.assert_array_equal(m.reliability.count, reference.reliability.count)
    equal_mass = model_calibration(known_classifier(), records(), LABELS, binning="equal_mass")
    assert equal_mass.reliability.binning.value == "equal_mass"


def test_batches_give_the_same_probabilities():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x = torch.randn(37, 5)
    whole = predict_probabilities(model, x)
    np.testing.assert_allclose(predict_probabilities(model, x, batch_size=4), whole, rtol=1e-6)
    np.testing.assert_allclose(whole.sum(axis=1), 1.0, atol=1e-12)


def test_evaluation_mode_without_gradients_and_the_training_mode_restored():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Dropout(0.5), torch.nn.Linear(6, 2))
    x = torch.randn(10, 4)
    model.train()
    first = predict_probabilities(model, x)
    np.testing.assert_array_equal(predict_probabilities(model, x), first)  # dropout is off
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    model.eval()
    predict_probabilities(model, x)
    assert not model.training


def test_a_float64_array_goes_to_a_float32_model():
    probs = predict_probabilities(known_classifier(torch.float32), np.eye(4))
    np.testing.assert_allclose(probs, PROBS, rtol=1e-5)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-12)


@pytest.mark.parametrize("shape", [(4,), (4, 1)])
def test_a_binary_classifier_with_one_logit(shape):
    # Logit of class 1 for record i is log(p_i / (1 − p_i)) with p = π_i1.
    p1 = PROBS[:, 1]

    class OneLogit(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.logit = torch.nn.Parameter(torch.tensor(np.log(p1 / (1 - p1))))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x @ self.logit).reshape((x.shape[0], *shape[1:]))

    probs = predict_probabilities(OneLogit(), records())
    np.testing.assert_allclose(probs, PROBS, rtol=1e-12)
    m = model_calibration(OneLogit(), records(), LABELS, num_bins=10)
    assert m.mce == pytest.approx(0.85)


def test_bad_arguments():
    model = known_classifier()
    with pytest.raises(InvalidParameterError, match="model"):
        predict_probabilities(lambda x: x, records())
    with pytest.raises(InvalidParameterError, match="batch_size"):
        predict_probabilities(model, records(), batch_size=0)
    with pytest.raises(InvalidParameterError, match="inputs"):
        predict_probabilities(model, torch.zeros(0, 4, dtype=torch.float64))
    with pytest.raises(InvalidParameterError, match="inputs"):
        predict_probabilities(model, object())
    with pytest.raises(InvalidParameterError, match="labels"):
        model_calibration(model, records(), np.array([0, 1, 2, 1]))


@pytest.mark.parametrize(
    "forward",
    [
        lambda x: x.sum(),  # a scalar for the whole batch
        lambda x: x.sum(0, keepdim=True),  # one row for the batch
        lambda x: x.reshape(x.shape[0], 2, 2),  # a third dimension
    ],
)
def test_outputs_of_the_wrong_shape(forward):
    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return forward(x * self.w)

    with pytest.raises(InvalidParameterError, match="outputs of shape"):
        predict_probabilities(Odd(), records())
