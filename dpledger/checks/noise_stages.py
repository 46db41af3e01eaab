"""The experiments the two noise checks share: an unclipped clip norm, the noise multiplier and
the noisy runs.

``unclipped_clip_norm`` (appendix B of "Finding Private Bugs"): at σ = 0, on a batch of ordinary
points, a grid of C; the smallest C from which the update stops changing clips nothing. The noise
checks then use 10 values of C in [C*, 10·C*]. The noise multiplier is given, 1.0 for plain SGD,
or (adaptive optimisers, appendix E) the largest σ of a grid for which the model moves in
proportion to σ at the largest C of the noise grid. The noisy runs are cached by (C, σ, steps), so
that ``noise_calibrated`` and ``noise_magnitude`` share them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dpledger.checks.report import Curve, format_value
from dpledger.checks.statistics import parameter_distance
from dpledger.checks.step_driver import StepDriver

__all__ = ["NoiseStages"]


class NoiseStages:
    """The shared noise experiments of one run of the checks, computed once each.

    Args:
        driver: the driver of the step under test.

    Attributes:
        start_params: the starting parameters of the last noisy run (float64; empty before one).
        machine_epsilon: machine epsilon of the parameters of the last noisy run.
    """

    def __init__(self, driver: StepDriver) -> None:
        self._driver = driver
        self._unclipped: dict[str, Any] | None = None
        self._sigma: dict[str, Any] | None = None
        self._noisy: dict[tuple[float, float, int], list[np.ndarray]] = {}
        self.start_params: np.ndarray = np.zeros(0)
        self.machine_epsilon = float(np.finfo(np.float64).eps)

    @property
    def chosen_noise_multiplier(self) -> float | None:
        """σ once :meth:`noise_multiplier` has run, else the given one (None if none)."""
        return (self._sigma or {}).get("sigma", self._driver.given_noise_multiplier)

    def unclipped_clip_norm(self) -> dict[str, Any]:
        """Appendix B: the smallest grid C from which the σ = 0 update stops changing.

        Returns a dict with ``clip_norm`` (C*, or None when none was found), ``reason``, and the
        ``curve`` (C, loss change, distance to the update at the largest C).
        """
        if self._unclipped is not None:
            return self._unclipped
        cfg = self._driver.config
        x, y = self._driver.noise_batch()
        clips = np.asarray(cfg.clip_norms)
        seed = self._driver.next_seed()
        outs = [
            self._driver.run(x, y, clip=c, sigma=0.0, seed=seed, steps=cfg.noise_steps)
            for c in clips
        ]
        ref = outs[-1]
        move = parameter_distance(ref.params_after, ref.params_before)
        eps = ref.machine_epsilon
        tol = max(
            cfg.saturation_rtol * move,
            100 * eps * float(np.linalg.norm(np.asarray(ref.params_before, float))),
        )
        gaps = np.array([parameter_distance(o.params_after, ref.params_after) for o in outs])
        delta = np.array([float(np.mean(o.losses_after) - np.mean(o.losses_before)) for o in outs])
        curve = Curve(
            "σ = 0 (appendix B search)",
            clips,
            delta,
            "clip norm C",
            "loss change",
            log_x=True,
            panel="unclipped C search",
        )
        knee = len(clips)
        while knee > 0 and gaps[knee - 1] <= tol:
            knee -= 1
        info: dict[str, Any] = {"curve": curve, "gaps": gaps, "movement": move}
        if move == 0 or not math.isfinite(move):
            info.update(clip_norm=None, reason="the step does not move the model at σ = 0")
        elif knee >= len(clips) - 1:
            info.update(
                clip_norm=None,
                reason=(
                    "the σ = 0 update still changes between the two largest C values "
                    f"({format_value(clips[-2])}, {format_value(clips[-1])}): no unclipped C in "
                    "the grid"
                ),
            )
        else:
            info.update(clip_norm=float(clips[knee]), reason="")
        self._unclipped = info
        return info

    def missing_unclipped_clip_norm(self) -> str | None:
        """Why a noise check cannot run for want of an unclipped C, as the sentence it reports
        (None when :meth:`unclipped_clip_norm` found one)."""
        search = self.unclipped_clip_norm()
        if search["clip_norm"] is not None:
            return None
        return f"No unclipped C was found ({search['reason']}); extend clip_norms upwards."

    def noise_multiplier(self) -> dict[str, Any]:
        """σ for the noise checks: given, 1.0 for plain SGD, or the appendix-B search."""
        if self._sigma is not None:
            return self._sigma
        if self._driver.given_noise_multiplier is not None:
            self._sigma = {"sigma": self._driver.given_noise_multiplier, "source": "given"}
        elif self._driver.plain_sgd:
            self._sigma = {"sigma": 1.0, "source": "default for plain SGD"}
        else:
            self._sigma = self._search_sigma()
        return self._sigma

    def _search_sigma(self) -> dict[str, Any]:
        """Appendix B's σ search, judged by linearity rather than by the loss change.

        At the largest C of the noise grid, one seed, each σ of ``noise_multiplier_grid``: the
        distance r(σ) = ‖θ_σ − θ_0‖ from the σ = 0 model. While the noise is small against the
        optimiser's state, r grows like σ; Adam's normalisation makes it saturate beyond that
        (appendix E). The chosen σ is the largest one up to which r(σ) stays proportional to σ
        (local elasticity within 10 % of 1), starting from the smallest σ whose effect is above
        round-off; over C ∈ [C*, span·C*] the noise then stays in the proportional regime.
        """
        cfg = self._driver.config
        star = self.unclipped_clip_norm()["clip_norm"]
        if star is None:
            return {"sigma": None, "source": "appendix-B search needs an unclipped C"}
        top = float(self.noise_grid(star)[-1])
        x, y = self._driver.noise_batch()
        seed = self._driver.next_seed()
        base = self._driver.run(x, y, clip=top, sigma=0.0, seed=seed, steps=cfg.noise_steps)
        sig = np.asarray(cfg.noise_multiplier_grid)
        r = np.array(
            [
                parameter_distance(
                    self._driver.run(
                        x, y, clip=top, sigma=s, seed=seed, steps=cfg.noise_steps
                    ).params_after,
                    base.params_after,
                )
                for s in sig
            ]
        )
        floor = (
            1e4
            * base.machine_epsilon
            * max(float(np.linalg.norm(np.asarray(base.params_after, float))), 1e-300)
        )
        visible = np.flatnonzero(r > floor)
        info: dict[str, Any] = {"grid": sig.tolist(), "distances": r.tolist(), "clip_norm": top}
        if visible.size == 0:
            info.update(sigma=None, source="appendix-B search: no σ in the grid moves the model")
            return info
        i = int(visible[0])
        while i + 1 < len(sig) and r[i + 1] > floor:
            local = math.log(r[i + 1] / r[i]) / math.log(sig[i + 1] / sig[i])
            if abs(local - 1.0) > 0.1:
                break
            i += 1
        if i == int(visible[0]):
            info.update(
                sigma=None,
                source="appendix-B search: the model distance is not proportional to σ anywhere",
            )
            return info
        info.update(
            sigma=float(sig[i]),
            source="appendix-B search (largest σ with distance ∝ σ at the largest C)",
        )
        return info

    def noise_grid(self, star: float) -> np.ndarray:
        """The C grid of the noise checks: ``noise_clip_norm_count`` values in [C*, span·C*]."""
        cfg = self._driver.config
        return np.linspace(star, cfg.noise_clip_norm_span * star, cfg.noise_clip_norm_count)

    def noisy_params(self, clip: float, sigma: float, count: int, steps: int) -> list[np.ndarray]:
        """Parameters after ``count`` runs of ``steps`` noisy steps at (C, σ), fresh seeds each."""
        key = (float(clip), float(sigma), steps)
        runs = self._noisy.setdefault(key, [])
        x, y = self._driver.noise_batch()
        while len(runs) < count:
            o = self._driver.run(x, y, clip=clip, sigma=sigma, steps=steps)
            runs.append(np.asarray(o.params_after, dtype=np.float64))
            self.start_params = np.asarray(o.params_before, dtype=np.float64)
            self.machine_epsilon = o.machine_epsilon
        return runs[:count]
