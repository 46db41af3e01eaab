"""μ-GDP ↔ (ε, δ) against the values printed by Bu, Dong, Long & Su (2020, "Deep Learning with
Gaussian Differential Privacy", Harvard Data Science Review), MNIST setting p = 256/60000:
μ = 0.35 ↔ (1.34, 1e-5) and μ = 1.78 ↔ (8.68, 1e-5). Only the conversion μ ↔ ε is checked (the
training settings behind each μ are not).

Both numbers are printed to two decimals, so the check is at that precision: the μ-GDP ε at δ = 1e-5
over the μ that round to the printed μ must reach the printed ε's rounding interval, and the μ
whose ε is the printed ε must round to the printed μ.
"""

from __future__ import annotations

import pytest
from scipy import optimize

from dpledger.accountants.gdp import gdp_epsilon


@pytest.mark.parametrize(("mu", "epsilon"), [(0.35, 1.34), (1.78, 8.68)])
def test_mu_and_epsilon_agree_to_the_printed_precision(mu: float, epsilon: float) -> None:
    """Bu et al. (2020), MNIST figure (p = 256/60000, δ = 1e-5)."""
    lo, hi = gdp_epsilon(mu - 0.005, 1e-5), gdp_epsilon(mu + 0.005, 1e-5)
    assert lo <= epsilon + 0.005 and hi >= epsilon - 0.005
    inverse = optimize.brentq(lambda m: gdp_epsilon(m, 1e-5) - epsilon, 0.01, 5.0, xtol=1e-12)
    assert round(inverse, 2) == mu
