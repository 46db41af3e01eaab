"""A dominating pair, and its PLD, for the Gaussian sum query on a sample drawn without replacement.

The mechanism is the one of :mod:`dpledger.accountants.without_replacement`: each step draws a
uniformly random subset of exactly b of the n records (γ = b/n), clips each sampled record to
L2 norm S, sums and adds N(0, σ̃²I) (z = σ̃/S); neighbouring datasets differ by **replacing** one
record. This module gives a pair of distributions (A, B) that *dominates* one step (Zhu, Dong &
Wang 2022, "Optimal Accounting of Differential Privacy via Characteristic Function", AISTATS:
H_α(M(x) ‖ M(x′)) ≤ H_α(A ‖ B) for every α ≥ 0 and every neighbouring x, x′, where H_α(P ‖ Q) =
sup_S P(S) − α·Q(S)); by their composition theorem the T-fold product (A^T, B^T) dominates T
adaptively composed steps, so the composed PLD of (A, B) gives a valid δ(ε).

The pair
--------
Write N(m) for N(m, σ̃²I) and let A₀ = (1 − γ)·N(0) + γ·N(2S·e), B₀ = N(0) (e a unit vector): the
remove pair of a Poisson-subsampled Gaussian with q = γ and sensitivity 2S, i.e. dp-accounting's
add/remove PLD at noise multiplier z/2. The dominating pair is the product

    A = A₀ ⊗ B₀,   B = B₀ ⊗ A₀,

whose privacy loss is the sum of the remove-direction loss of (A₀, B₀) and the add-direction loss
of (B₀, A₀); its PLD is the convolution of dp-accounting's two PMFs, symmetric in the two orders.

Why it dominates
----------------
1. *Coupling.* Fix neighbours x, x′ that differ in record i (values v, v′, ‖v‖, ‖v′‖ ≤ S after
   clipping). Draw a uniform (b − 1)-subset R of the other n − 1 records and one more record j
   uniformly among the remaining others; then R ∪ {j} is a uniform b-subset of the others and
   R ∪ {i} a uniform b-subset containing i. Record i is in the batch with probability γ, so with
   s = Σ_R (the same in x and x′) and y the value of j,

       M(x)  = E_{R,j}[(1 − γ)·N(s + y) + γ·N(s + v)],
       M(x′) = E_{R,j}[(1 − γ)·N(s + y) + γ·N(s + v′)],

   mixtures with the *same* weights of the pairs P_y = (1 − γ)N(y) + γN(v), Q_y = (1 − γ)N(y) +
   γN(v′) (shifted by s, which does not change a divergence). H_α is jointly convex, so
   H_α(M(x) ‖ M(x′)) ≤ sup_{y, v, v′} H_α(P_y ‖ Q_y), all of norm ≤ S.
2. *Advanced joint convexity* (Balle, Barthe & Gaboardi 2018, "Privacy Amplification by
   Subsampling: Tight Analyses via Couplings and Divergences", Theorem 2): for ε ≥ 0,
   ε′ = log(1 + γ(e^ε − 1)) and β = e^{ε′ − ε},

       H_{e^{ε′}}(P_y ‖ Q_y) = γ·H_{e^ε}(N(v) ‖ (1 − β)N(y) + βN(v′))
                             ≤ γ·[(1 − β)·H_{e^ε}(N(v) ‖ N(y)) + β·H_{e^ε}(N(v) ‖ N(v′))]
                             ≤ γ·δ_G(ε),

   δ_G the hockey-stick of two Gaussians 2S apart (‖v − y‖, ‖v − v′‖ ≤ 2S and the Gaussian's
   hockey-stick grows with the distance). The same theorem with N(y) = N(v′) = B₀ gives
   H_{e^{ε′}}(A₀ ‖ B₀) = γ·δ_G(ε): equality. By symmetry (swap v and v′) the same bound holds for
   H(Q_y ‖ P_y). So for every α ≥ 1, both orders of every step are at most H_α(A₀ ‖ B₀).
3. *Both orders, every α.* For α < 1, H_α(P ‖ Q) = 1 − α + α·H_{1/α}(Q ‖ P), so a dominating pair
   must also exceed the *reverse* order at 1/α. (A₀, B₀) alone need not: H(B₀ ‖ A₀) is smaller
   than H(A₀ ‖ B₀). The product pair exceeds both, since dropping a coordinate is a
   post-processing: H_α(A ‖ B) ≥ H_α(A₀ ‖ B₀) (first coordinate) and H_α(B ‖ A) ≥ H_α(A₀ ‖ B₀)
   (second coordinate). Hence, for α ≥ 1, H_α(M(x) ‖ M(x′)) ≤ H_α(A₀ ‖ B₀) ≤ H_α(A ‖ B), and for
   α < 1, H_α(M(x) ‖ M(x′)) = 1 − α + α·H_{1/α}(M(x′) ‖ M(x)) ≤ 1 − α + α·H_{1/α}(B ‖ A) =
   H_α(A ‖ B).

Tightness: the neighbours "every other record contributes +S·e; record i is −S·e in x and +S·e in
x′" realise (A₀, B₀) exactly at every step (x′ always releases N(bS·e), x releases N((b − 2)S·e)
with probability γ), so the composed ε of (A₀, B₀) is a lower bound on the mechanism's. The
product pair costs the add-direction loss on top; at b = 256, n = 60,000, z = 1.1, T = 2000,
δ = 1e-5 it gives ε = 7.08 against 10.91 for the RDP bound of Wang, Balle & Kasiviswanathan and a
lower bound of 6.26 (``benchmarks/bounds_bench.py``).

Discretisation: dp-accounting's pessimistic PLDs (connect the dots) of the two directions, each an
upper bound on its direction's δ(ε); the convolution of two pessimistic PMFs is pessimistic for
the product (dp-accounting's ``compose``), with at most its ``tail_mass_truncation`` moved to an
infinite loss.
"""

from __future__ import annotations

from typing import Any

from dpledger.validation import check_positive_finite, check_probability

__all__ = ["without_replacement_pld"]


def without_replacement_pld(
    sampling_ratio: float, noise_multiplier: float, *, value_discretization_interval: float
) -> Any:
    """The pessimistic PLD of the dominating pair of one step (see the module docstring).

    Args:
        sampling_ratio: γ = b/n in (0, 1].
        noise_multiplier: z = σ̃/S, finite and > 0 (the replace-one sensitivity 2S is built in).
        value_discretization_interval: the PLD's grid of loss values.

    Returns:
        A symmetric dp-accounting ``PrivacyLossDistribution``: its δ(ε), composed with itself T
        times, is an upper bound on the δ(ε) of T steps under replace-one.

    Raises:
        InvalidParameterError: γ outside (0, 1] or z not finite and > 0.
    """
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    gamma = check_probability("sampling_ratio", sampling_ratio)
    z = check_positive_finite("noise_multiplier", noise_multiplier)
    if gamma == 0.0:
        from dpledger.errors import InvalidParameterError

        raise InvalidParameterError("sampling_ratio", sampling_ratio, "a number in (0, 1]")
    half = pld_lib.from_gaussian_mechanism(
        standard_deviation=z / 2.0,
        sampling_prob=gamma,
        pessimistic_estimate=True,
        value_discretization_interval=value_discretization_interval,
    )
    # dp-accounting keeps the two directions' PMFs in private attributes and offers no public
    # accessor; the product pair's PMF is their convolution (the loss of A₀ ⊗ B₀ against B₀ ⊗ A₀).
    remove, add = half._pmf_remove, half._pmf_add
    return pld_lib.PrivacyLossDistribution(remove.compose(add))
