"""The shared parameter checks in dpledger.validation."""

from __future__ import annotations

import enum
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpledger.errors import InvalidParameterError
from dpledger.validation import (
    check_bool,
    check_delta,
    check_enum,
    check_finite,
    check_non_negative_finite,
    check_non_negative_int,
    check_optional_str,
    check_positive_finite,
    check_positive_int,
    check_probability,
)

FLOAT_CHECKS = {
    check_finite: lambda x: math.isfinite(x),
    check_positive_finite: lambda x: 0.0 < x < math.inf,
    check_non_negative_finite: lambda x: 0.0 <= x < math.inf,
    check_probability: lambda x: 0.0 <= x <= 1.0,
    check_delta: lambda x: 0.0 < x < 1.0,
}

NOT_NUMBERS = [True, False, np.True_, np.array(True), "0.5", b"1", None, [0.5], 1j, np.array([0.5])]


@pytest.mark.parametrize("check", list(FLOAT_CHECKS))
@given(x=st.floats(allow_nan=True, allow_infinity=True))
def test_float_checks_accept_exactly_their_domain(check, x: float) -> None:
    valid = FLOAT_CHECKS[check]
    if valid(x):
        out = check("p", x)
        assert type(out) is float
        assert out == x
        assert math.copysign(1.0, out) == 1.0 or out != 0.0 or check is check_finite
    else:
        with pytest.raises(InvalidParameterError) as info:
            check("p", x)
        assert info.value.parameter == "p"
        assert str(info.value).startswith(f"p={x!r} is invalid")


@pytest.mark.parametrize("check", list(FLOAT_CHECKS))
@pytest.mark.parametrize("value", NOT_NUMBERS, ids=repr)
def test_float_checks_refuse_non_numbers(check, value) -> None:
    with pytest.raises(InvalidParameterError) as info:
        check("my_param", value)
    assert info.value.parameter == "my_param"
    assert info.value.value is value
    assert "my_param=" in str(info.value)


@pytest.mark.parametrize("check", list(FLOAT_CHECKS))
def test_float_checks_convert_numpy_and_fractions(check) -> None:
    for value in (np.float32(0.5), np.float64(0.5), np.array(0.5), Fraction(1, 2)):
        out = check("p", value)
        assert type(out) is float and out == 0.5
    if check is not check_delta and check is not check_probability:
        assert check("p", np.int64(3)) == 3.0
        assert check("p", np.array(3, dtype=np.uint8)) == 3.0


def test_huge_int_is_a_typed_error_not_overflow() -> None:
    # described by its size: a 400-digit value is not printed (nor, past 4300 digits, printable)
    with pytest.raises(InvalidParameterError, match=r"p=<an integer of 1329 bits"):
        check_probability("p", 10**400)
    with pytest.raises(InvalidParameterError):
        check_finite("p", -(10**400))


def test_signed_zero_becomes_positive_zero() -> None:
    for check in (check_probability, check_non_negative_finite):
        out = check("p", -0.0)
        assert out == 0.0 and math.copysign(1.0, out) == 1.0


@given(x=st.integers(min_value=-(10**30), max_value=10**30))
def test_int_checks(x: int) -> None:
    if x >= 1:
        assert check_positive_int("n", x) == x
    else:
        with pytest.raises(InvalidParameterError, match=f"n={x}"):
            check_positive_int("n", x)
    if x >= 0:
        assert check_non_negative_int("n", x) == x
    else:
        with pytest.raises(InvalidParameterError, match=f"n={x}"):
            check_non_negative_int("n", x)


@pytest.mark.parametrize("value", [1.0, 2.5, True, np.True_, "3", None, np.array([3]), math.nan])
def test_int_checks_refuse_non_integers(value) -> None:
    for check in (check_positive_int, check_non_negative_int):
        with pytest.raises(InvalidParameterError) as info:
            check("count", value)
        assert info.value.parameter == "count"


def test_int_checks_accept_numpy_integers() -> None:
    assert check_positive_int("n", np.int64(7)) == 7
    assert type(check_positive_int("n", np.array(7))) is int
    assert check_non_negative_int("n", np.uint16(0)) == 0


class _Colour(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


def test_check_enum_accepts_members_and_values_and_names_the_valid_ones():
    assert check_enum("colour", _Colour.RED, _Colour) is _Colour.RED
    assert check_enum("colour", "blue", _Colour) is _Colour.BLUE
    for bad in ("green", "RED", None, 3):
        with pytest.raises(InvalidParameterError, match="one of 'red', 'blue'") as info:
            check_enum("colour", bad, _Colour)
        assert info.value.parameter == "colour"


def test_check_bool_accepts_only_python_bools() -> None:
    assert check_bool("flag", True) is True and check_bool("flag", False) is False
    for bad in (0, 1, np.True_, "True", None):
        with pytest.raises(InvalidParameterError, match=r"flag.*True or False"):
            check_bool("flag", bad)


def test_check_optional_str_returns_plain_text_or_none() -> None:
    class Name(str):
        pass

    assert check_optional_str("label", None) is None
    assert check_optional_str("label", "g") == "g"
    plain = check_optional_str("label", Name("g"))
    assert type(plain) is str and plain == "g"
    for bad in (1, b"g", np.str_):
        with pytest.raises(InvalidParameterError, match=r"label.*a string or None"):
            check_optional_str("label", bad)
