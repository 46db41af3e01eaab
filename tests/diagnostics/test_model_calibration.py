"""Tests of NLL, ECE, MCE and reliability-diagram data on classifiers with known confidences."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpledger.diagnostics.model_calibration import (
    Binning,
    ModelCalibrationMetrics,
    model_calibration_metrics,
)
from dpledger.errors import InvalidParameterError

# A tiny two-class classifier: confidences 0.95 (right), 0.85 (wrong), 0.75 (right), 0.65 (right).
PROBS = np.array([[0.95, 0.05], [0.85, 0.15], [0.25, 0.75], [0.35, 0.65]])
LABELS = np.array([0, 1, 1, 1])


def test_equal_width_by_hand():
    m = model_calibration_metrics(PROBS, LABELS, num_bins=10)
    assert isinstance(m, ModelCalibrationMetrics)
    assert m.num_examples == 4
    assert m.accuracy == 0.75
    assert m.mean_confidence == pytest.approx(0.8)
    # One example per bin: gaps |1 − .95|, |0 − .85|, |1 − .75|, |1 − .65|.
    assert m.ece == pytest.approx((0.05 + 0.85 + 0.25 + 0.35) / 4)
    assert m.mce == pytest.approx(0.85)
    assert m.nll == pytest.approx(
        -(math.log(0.95) + math.log(0.15) + math.log(0.75) + math.log(0.65)) / 4
    )
    rel = m.reliability
    assert rel.binning is Binning.EQUAL_WIDTH
    np.testing.assert_allclose(rel.lower, np.arange(10) / 10)
    np.testing.assert_allclose(rel.upper, np.arange(1, 11) / 10)
    assert rel.count.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    np.testing.assert_allclose(rel.confidence[6:], [0.65, 0.75, 0.85, 0.95])
    np.testing.assert_allclose(rel.accuracy[6:], [1.0, 1.0, 0.0, 1.0])
    assert np.all(np.isnan(rel.accuracy[:6]))  # empty bins


def test_coarser_equal_width_bins_average_within_a_bin():
    m = model_calibration_metrics(PROBS, LABELS, num_bins=2)
    # Everything lands in (0.5, 1]: accuracy .75, confidence .8.
    assert m.reliability.count.tolist() == [0, 4]
    assert m.ece == pytest.approx(0.05)
    assert m.mce == pytest.approx(0.05)


def test_equal_mass_by_hand():
    m = model_calibration_metrics(PROBS, LABELS, num_bins=2, binning="equal_mass")
    # Sorted confidences .65 .75 | .85 .95: accuracies 1 and .5, confidences .7 and .9.
    rel = m.reliability
    assert rel.binning is Binning.EQUAL_MASS
    assert rel.count.tolist() == [2, 2]
    np.testing.assert_allclose(rel.lower, [0.65, 0.85])
    np.testing.assert_allclose(rel.upper, [0.75, 0.95])
    np.testing.assert_allclose(rel.confidence, [0.7, 0.9])
    np.testing.assert_allclose(rel.accuracy, [1.0, 0.5])
    assert m.ece == pytest.approx(0.5 * 0.3 + 0.5 * 0.4)
    assert m.mce == pytest.approx(0.4)
    np.testing.assert_allclose(rel.gap, [0.3, 0.4])


def test_binary_probabilities_as_a_vector():
    p1 = PROBS[:, 1]
    assert model_calibration_metrics(p1, LABELS).scalars() == pytest.approx(
        model_calibration_metrics(PROBS, LABELS).scalars()
    )


def test_three_classes_and_a_confidence_on_a_bin_edge():
    probs = np.array([[0.5, 0.25, 0.25], [0.2, 0.2, 0.6], [0.1, 0.8, 0.1]])
    labels = np.array([0, 1, 1])
    m = model_calibration_metrics(probs, labels, num_bins=4)
    # 0.5 lies on the edge between (0.25, 0.5] and (0.5, 0.75]: it belongs to the lower bin.
    assert m.reliability.count.tolist() == [0, 1, 1, 1]
    assert m.accuracy == pytest.approx(2 / 3)
    assert m.nll == pytest.approx(-(math.log(0.5) + math.log(0.2) + math.log(0.8)) / 3)
    assert m.ece == pytest.approx((0.5 + 0.6 + 0.2) / 3)
    assert m.mce == pytest.approx(0.6)


def test_nll_is_infinite_when_the_true_class_has_probability_zero():
    m = model_calibration_metrics(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([1, 1]))
    assert m.nll == math.inf
    assert m.ece == pytest.approx(0.5)


@pytest.mark.statistical
def test_a_calibrated_classifier_has_small_ece():
    # Labels drawn so that P(correct | confidence p) = p: the binned ECE is sampling noise only.
    # With n examples in B bins, each bin's |acc − conf| has standard error about
    # sqrt(p(1 − p)/n_b) ≤ 0.5/sqrt(n/B); ECE averages them, so 4 standard errors bound it.
    rng = np.random.default_rng(0)
    n, bins = 20_000, 10
    conf = rng.uniform(0.5, 1.0, n)
    correct = rng.random(n) < conf
    labels = np.where(correct, 0, 1)
    probs = np.stack([conf, 1 - conf], axis=1)
    m = model_calibration_metrics(probs, labels, num_bins=bins)
    assert m.ece < 4 * 0.5 / math.sqrt(n / bins)
    # An over-confident classifier (true accuracy = confidence − 0.2) is caught.
    labels_over = np.where(rng.random(n) < conf - 0.2, 0, 1)
    over = model_calibration_metrics(probs, labels_over, num_bins=bins)
    assert over.ece == pytest.approx(0.2, abs=4 * 0.5 / math.sqrt(n / bins))


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"probabilities": [[0.5, 0.6]], "labels": [0]}, "probabilities"),
        ({"probabilities": [[1.2, -0.2]], "labels": [0]}, "probabilities"),
        ({"probabilities": [[np.nan, 1.0]], "labels": [0]}, "probabilities"),
        ({"probabilities": [[1.0]], "labels": [0]}, "probabilities"),
        ({"probabilities": [[0.5, 0.5]], "labels": [2]}, "labels"),
        ({"probabilities": [[0.5, 0.5]], "labels": [0.0]}, "labels"),
        ({"probabilities": [[0.5, 0.5]], "labels": [0, 1]}, "labels"),
        ({"probabilities": [[0.5, 0.5]], "labels": [0], "num_bins": 0}, "num_bins"),
        ({"probabilities": [[0.5, 0.5]], "labels": [0], "binning": "log"}, "binning"),
    ],
)
def test_bad_inputs_are_refused(kwargs, parameter):
    with pytest.raises(InvalidParameterError) as info:
        model_calibration_metrics(**kwargs)
    assert info.value.parameter == parameter
