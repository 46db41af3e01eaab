"""The certified ε of composed privacy losses: the search for where δ(ε) crosses δ.

:class:`~dpledger.accountants.prv.accountant.PrvAccountant` composes each direction's privacy
loss (:class:`~dpledger.accountants.prv.composition.ComposedLoss`, remove and add) and hands the
composed laws to :func:`_search_epsilon` as :class:`_Bounds`. The search brackets, on vectorised
grids of ε, the points where the upper criterion (max_d δ_d + upper slack_d ≤ δ), the estimate
(max_d δ_d = δ) and each direction's lower criterion (δ_d − lower slack_d > δ, less the
direction's shift) change, refines the brackets that decide the answer, and checks every point
it returns, so the interpolation only affects how tight the bounds are, never whether they hold.
"""

from __future__ import annotations

import attrs
import numpy as np

from dpledger.accountants.prv.composition import ComposedLoss
from dpledger.accountants.prv.deadline import PrvNumericalError
from dpledger.accountants.prv.gaussian import gaussian_epsilon

__all__: list[str] = []


@attrs.frozen
class _Bounds:
    """The composed laws of each direction for one ledger (or prefix)."""

    directions: tuple[ComposedLoss, ...]
    mesh_width: float

    def estimate(self, eps: float) -> float:
        return max(d.delta(eps) for d in self.directions)

    def upper(self, eps: float) -> float:
        return max(d.delta(eps) + d.upper_slack for d in self.directions)

    def top(self) -> float:
        return max(d.top for d in self.directions)


def _search_epsilon(
    bounds: _Bounds, delta: float, hint: tuple[float, float] | None = None
) -> dict[str, float]:
    """Certified lower and upper ε and the estimate.

    With δ_d(ε) the computed δ of direction d (remove, add), the upper bound is a point where
    max_d δ_d + slack_d ≤ δ holds, and the lower bound of direction d is a point where
    δ_d − lower_slack_d > δ was evaluated, minus d's shift; the estimate is where max_d δ_d
    crosses δ. The crossings are bracketed on vectorised grids (over the window, or over
    ``hint`` when it brackets them) and located by linear interpolation; the points returned
    are checked, so the interpolation only affects how tight they are. A direction whose upper
    criterion already holds at the left end of the brackets is not evaluated inside them (δ_d
    decreases in ε), and the returned upper bound is re-checked with every direction.
    """
    dirs = bounds.directions
    up_slack = np.array([d.upper_slack for d in dirs])[:, None]
    lo_slack = np.array([d.lower_slack for d in dirs])[:, None]
    names = ["upper", "estimate", *[f"lower{i}" for i in range(len(dirs))]]
    no_skip = (False,) * len(dirs)

    def excess(eps: np.ndarray, skip: tuple[bool, ...] = no_skip) -> np.ndarray:
        """The excess over δ of each criterion (positive: not met), one row per criterion;
        directions in ``skip`` are taken as 0 (their criteria met)."""
        values = np.array(
            [np.zeros(eps.size) if skip[i] else d.delta_many(eps) for i, d in enumerate(dirs)]
        )
        upper = (values + up_slack).max(axis=0) - delta
        estimate = values.max(axis=0) - delta
        return np.vstack([upper, estimate, values - lo_slack - delta])

    def brackets(grid: np.ndarray, ex: np.ndarray) -> dict[str, tuple]:
        """Per criterion: (a, b, interpolated crossing or None, status) where a is the last
        unmet and b the first met grid point; status "never" (not met on the grid, a = b =
        its last point) or "start" (met at its first point, a = b = that point)."""
        met = ex <= 0
        out = {}
        for row, name in enumerate(names):
            if not met[row].any():  # a lower criterion need not be met inside the grid
                out[name] = (grid[-1], grid[-1], None, "never")
                continue
            i = int(met[row].argmax())
            if i == 0:
                out[name] = (grid[0], grid[0], None, "start")
                continue
            a, b = grid[i - 1], grid[i]
            fa, fb = ex[row, i - 1], ex[row, i]
            out[name] = (a, b, a + (b - a) * fa / (fa - fb), "bracket")
        return out

    found = None
    if hint is not None and hint[1] > hint[0] >= 0:
        grid = np.linspace(hint[0], hint[1], 49)
        ex = excess(grid)
        # usable if the upper bound and the estimate start unmet and the upper bound ends met
        if ex[0, -1] <= 0 and np.all(ex[:2, 0] > 0):
            found = brackets(grid, ex)
    if found is None:
        mu = dirs[0].gaussian_mu
        extra = gaussian_epsilon(delta / 4, mu)[1] if mu > 0 else 0.0
        hi = max(bounds.top(), 0.0) + extra + 2 * bounds.mesh_width
        for _ in range(64):
            grid = np.linspace(0.0, hi, 65)
            ex = excess(grid)
            if ex[0, -1] <= 0:
                break
            hi = 2 * hi + 1.0
        else:
            raise PrvNumericalError(f"the upper bound on delta never reaches {delta:g}")
        found = brackets(grid, ex)
    # refine the criteria that decide the answer: upper, estimate, and each direction's lower
    # criterion unless its crossing lies wholly below the estimate's (it then cannot give the
    # largest lower bound, and its coarse point stays valid)
    est_lo = found["estimate"][0]
    pending = [0, 1] + [2 + i for i in range(len(dirs)) if found[f"lower{i}"][1] > est_lo]
    start = min(found[names[r]][0] for r in pending)
    at_start = ex[:, int(np.searchsorted(grid, start))]
    skip = tuple(
        bool(at_start[2 + i] + d.lower_slack + d.upper_slack < 0) and (2 + i) not in pending
        for i, d in enumerate(dirs)
    )
    for _ in range(10):
        spans = sorted((found[names[r]][0], found[names[r]][1], r) for r in pending)
        clusters: list[list] = []
        for lo_x, hi_x, r in spans:
            if clusters and lo_x <= clusters[-1][1]:
                clusters[-1][1] = max(clusters[-1][1], hi_x)
                clusters[-1][2].append(r)
            else:
                clusters.append([lo_x, hi_x, [r]])
        pending = []
        for lo_x, hi_x, members in clusters:
            if hi_x - lo_x <= 1e-4 * max(1.0, hi_x):
                continue  # interpolation error ~ spacing²·curvature/48² is then negligible
            grid = np.linspace(lo_x, hi_x, 49)
            fine = brackets(grid, excess(grid, skip))
            for r in members:
                found[names[r]] = fine[names[r]]
            pending += members
        if not pending:
            break
    tol = 1e-9 * max(1.0, found["upper"][1])
    # upper: the interpolated crossing nudged up if it checks out, else the grid point
    a, b, c, _ = found["upper"]
    upper = b
    nudged = c is not None and c + tol < b
    if nudged and excess(np.array([c + tol]), skip)[0, 0] <= 0:
        upper = c + tol
    while excess(np.array([upper]))[0, 0] > 0:  # every direction, to be sure
        upper += max(b - a, tol)
    a, b, c, _ = found["estimate"]
    estimate = b if c is None else c
    lower = 0.0
    for i, d in enumerate(dirs):
        a, b, c, status = found[f"lower{i}"]
        if status == "start":
            continue  # no point below the crossing was evaluated: nothing to certify
        point = a  # evaluated unmet on a grid (the lower rows are never skipped)
        inside = c is not None and c - tol > a
        if inside and d.delta_many(np.array([c - tol]))[0] - d.lower_slack > delta:
            point = c - tol
        lower = max(lower, point - d.shift)
    return {"lower": min(lower, estimate), "estimate": estimate, "upper": max(upper, estimate)}
