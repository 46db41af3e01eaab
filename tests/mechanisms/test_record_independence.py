"""The record-independence probe's verdicts, written once for both adapters: which record
replaces record 0, when rows j >= 1 moved, which layer mixes, when a record's gradient moved,
and the typed errors.

References: the tolerance 1024·ε·‖|a_j| + |b_j|‖ computed by hand in each test; differences
placed just inside and just outside it.
"""

from __future__ import annotations

import numpy as np
import pytest

from dpledger.errors import (
    InvalidParameterError,
    RecordDependenceError,
    RecordProbeError,
    SamplerMismatchError,
)
from dpledger.mechanisms.record_independence import (
    PROBE_RECORDS,
    first_mixing_call,
    other_record,
    probe_size,
    refuse_mixing,
    refuse_moved_gradients,
    rows_moved,
    run_probe_step,
)

EPS32 = float(np.finfo(np.float32).eps)


@pytest.mark.parametrize("bad", [1, 0, True, 2.0, "4", None])
def test_max_records_below_two_or_not_an_integer_is_refused(bad: object) -> None:
    with pytest.raises(InvalidParameterError, match="max_records"):
        probe_size(8, bad)


def test_probe_size_is_the_first_records_and_none_below_two() -> None:
    assert probe_size(10, PROBE_RECORDS) == 4 and probe_size(3, 4) == 3 and probe_size(3, 2) == 2
    assert probe_size(1, 4) is None and probe_size(None, 4) is None


def test_the_record_that_replaces_record_zero_is_the_first_that_differs() -> None:
    x = np.array([[1.0, 2.0], [1.0, 2.0], [3.0, 2.0], [5.0, 5.0]])
    labels = np.array([0, 0, 0, 1])
    assert other_record([x, labels], 4) == 2
    assert other_record([x[:2], labels[:2]], 2) is None  # all equal: permute record 0
    assert other_record([x[:2], np.array([0, 1])], 2) == 1  # differs in the labels only


def test_rows_moved_ignores_record_zero_and_rounding_within_the_tolerance() -> None:
    """Row 1 = (3, 4), its first entry changed: only entries that differ count, so the
    tolerance is 1024·ε·(3 + 3 + δ) ≈ 1024·ε·6; δ = 1000·ε·6 stays inside it, 1100·ε·6 does
    not."""
    a = np.array([[0.0, 0.0], [3.0, 4.0]])
    b = a.copy()
    b[0] = 99.0  # record 0 changed: not looked at
    assert rows_moved(a, b, eps=EPS32) is False
    inside, outside = a.copy(), a.copy()
    inside[1, 0] += 1000 * EPS32 * 6
    outside[1, 0] += 1100 * EPS32 * 6
    assert rows_moved(a, inside, eps=EPS32) is False
    assert rows_moved(a, outside, eps=EPS32) is True


def test_rows_moved_on_non_finite_integers_and_shapes() -> None:
    a = np.array([[0.0, 0.0], [np.inf, np.nan]])
    assert rows_moved(a, a.copy(), eps=EPS32) is False  # inf with inf, NaN with NaN
    b = a.copy()
    b[1, 0] = 1.0
    assert rows_moved(a, b, eps=EPS32) is True  # inf against a finite value
    ints = np.array([[0, 1], [2, 3]])
    other = ints.copy()
    other[1, 1] = 4
    assert rows_moved(ints, other, eps=None) is True and rows_moved(ints, ints, eps=None) is False
    assert rows_moved(a, a[:, :1], eps=EPS32) is None


def _moved(a: np.ndarray, b: np.ndarray) -> bool | None:
    return rows_moved(a, b, eps=EPS32)


def test_the_first_call_whose_inputs_stayed_but_outputs_moved_is_named() -> None:
    same, mixed = np.array([[0.0], [1.0]]), np.array([[0.0], [2.0]])
    calls_a = {
        ("", 0): ([same], [same]),
        ("body", 0): ([same], [same]),
        ("body.fc", 0): ([same], [same]),
        ("head", 0): ([same], [same]),
    }
    calls_b = {
        ("", 0): ([same], [mixed]),  # the model: its output moved
        ("body", 0): ([same], [mixed]),  # mixes in its own code ...
        ("body.fc", 0): ([mixed], [mixed]),  # ... so its child receives mixed inputs
        ("head", 0): ([mixed], [mixed]),
    }
    found = first_mixing_call(calls_a, calls_b, moved=_moved, name_of=lambda k: k[0])
    assert found == (("", 0), ("body.fc", 0))  # the model, its first child with mixed inputs
    del calls_a[("", 0)]
    found = first_mixing_call(calls_a, calls_b, moved=_moved, name_of=lambda k: k[0])
    assert found == (("body", 0), ("body.fc", 0))
    calls_b[("body", 0)] = ([same], [same])
    calls_b[("body.fc", 0)] = ([same], [mixed])
    found = first_mixing_call(calls_a, calls_b, moved=_moved, name_of=lambda k: k[0])
    assert found == (("body.fc", 0), None)
    unchanged = {k: (ins, ins) for k, (ins, _) in calls_a.items()}
    assert first_mixing_call(calls_a, unchanged, moved=_moved, name_of=lambda k: k[0]) is None


def test_a_mixing_layer_is_refused_with_its_name_and_type() -> None:
    err = refuse_mixing(
        kind="layer", name="centre", layer_type="Lambda", m=3, what="changed x.", advice="Fix."
    )
    assert isinstance(err, RecordDependenceError)
    assert (err.layer_name, err.layer_type) == ("centre", "Lambda")
    assert "layer 'centre' (Lambda) mixes the records" in str(err)
    assert "3-record probe batch changed x." in str(err) and str(err).endswith("Fix.")
    model = refuse_mixing(kind="module", name="", layer_type="Net", m=2, what="x.", advice="")
    assert "module the model (Net)" in str(model)


def test_a_moved_gradient_names_the_record_and_the_parameters() -> None:
    """Record 2's gradient of 'w' moves by 0.5 (far beyond 1024·ε·‖…‖); 'b' stays."""
    rng = np.random.default_rng(0)
    grads_a = {"w": rng.standard_normal((4, 3, 2)), "b": rng.standard_normal((4, 2))}
    grads_b = {k: v.copy() for k, v in grads_a.items()}
    grads_b["w"][0] += 1.0  # record 0: changed on purpose, not looked at
    refuse_moved_gradients(grads_a, grads_b, m=4, eps=EPS32)
    grads_b["w"][2, 1, 0] += 0.5
    with pytest.raises(RecordDependenceError, match="the backward mixes records") as info:
        refuse_moved_gradients(grads_a, grads_b, m=4, eps=EPS32)
    assert "of record 2" in str(info.value) and info.value.parameters == ("w",)
    grads_b["w"][2, 1, 0] = np.nan
    with pytest.raises(RecordDependenceError, match="record 2"):
        refuse_moved_gradients(grads_a, grads_b, m=4, eps=EPS32)


def test_a_failing_model_is_a_probe_error_and_dpledger_errors_pass_through() -> None:
    def fails() -> None:
        raise ValueError("shape mismatch")

    with pytest.raises(RecordProbeError, match="check_record_independence=False") as info:
        run_probe_step(fails, m=3, run="changed", other=1)
    assert info.value.run == "changed" and isinstance(info.value.__cause__, ValueError)

    def refused() -> None:
        raise SamplerMismatchError("not drawn")

    with pytest.raises(SamplerMismatchError):
        run_probe_step(refused, m=3, run="original", other=None)
    assert run_probe_step(lambda: 7, m=2, run="original", other=None) == 7
