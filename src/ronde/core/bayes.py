"""Bayesian optimisation of a few continuous knobs: a Gaussian process and expected
improvement, in numpy (the autotuner's search, see ``autotune.py``).

Inputs live in the unit cube (the caller maps knob ranges onto it); scores are
standardised before fitting, so the noise term ``alpha`` is relative to the scores'
own spread (Horovod's ``HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE`` has the same
meaning). The kernel is a squared exponential whose length scale is chosen among a
few by the marginal likelihood; the next point is the candidate of a fixed grid (plus
seeded random points) with the largest expected improvement. Everything is
deterministic for a given sample history, so a run can be replayed.

Considered instead: scikit-optimize and scikit-learn's GaussianProcessRegressor (a
heavy dependency for 60 lines of linear algebra on at most a few dozen points).
"""

from __future__ import annotations

import math

import numpy as np

_LENGTH_SCALES = (0.08, 0.12, 0.18, 0.25, 0.35, 0.5, 0.8)


def _kernel(a: np.ndarray, b: np.ndarray, length: float) -> np.ndarray:
    d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(axis=-1)
    return np.exp(-0.5 * d2 / (length * length))


class GaussianProcess:
    """A zero-mean GP on standardised scores (fit once per suggestion)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, alpha: float) -> None:
        self.x = x
        self.mean = float(y.mean())
        self.std = float(y.std()) or 1.0
        self.y = (y - self.mean) / self.std
        self.alpha = max(alpha, 1e-6)
        best = None
        for length in _LENGTH_SCALES:
            fit = self._fit(length)
            if fit is not None and (best is None or fit[0] > best[0]):
                best = fit
        assert best is not None, "the noise term keeps the kernel matrix positive definite"
        _, self.length, self.chol, self.weights = best

    def _fit(self, length: float) -> tuple[float, float, np.ndarray, np.ndarray] | None:
        k = _kernel(self.x, self.x, length) + self.alpha * np.eye(len(self.x))
        try:
            chol = np.linalg.cholesky(k)
        except np.linalg.LinAlgError:
            return None
        weights = np.linalg.solve(chol.T, np.linalg.solve(chol, self.y))
        # log marginal likelihood, up to a constant
        lml = -0.5 * float(self.y @ weights) - float(np.log(np.diag(chol)).sum())
        return lml, length, chol, weights

    def predict(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation (standardised units) at ``points``."""
        ks = _kernel(points, self.x, self.length)
        mu = ks @ self.weights
        v = np.linalg.solve(self.chol, ks.T)
        var = np.clip(1.0 - (v * v).sum(axis=0), 1e-12, None)
        return mu, np.sqrt(var)


def expected_improvement(mu: np.ndarray, sigma: np.ndarray, best: float,
                         xi: float = 0.01) -> np.ndarray:
    """How much each point is expected to beat ``best`` (maximisation)."""
    z = (mu - best - xi) / sigma
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return (mu - best - xi) * cdf + sigma * pdf


class BayesianOptimizer:
    """Suggests the next point of the unit cube ``[0, 1]^dims`` to sample."""

    def __init__(self, dims: int, alpha: float, grid: int = 0, seed: int = 0) -> None:
        self.dims = dims
        self.alpha = alpha
        self.xs: list[np.ndarray] = []
        self.ys: list[float] = []
        per_dim = grid or (201 if dims == 1 else 33 if dims == 2 else 9)
        axes = np.meshgrid(*([np.linspace(0.0, 1.0, per_dim)] * dims), indexing="ij")
        lattice = np.stack([a.ravel() for a in axes], axis=1)
        rng = np.random.default_rng(seed)
        self.candidates = np.concatenate([lattice, rng.random((256, dims))])

    def add(self, x: np.ndarray | list[float], y: float) -> None:
        self.xs.append(np.asarray(x, dtype=np.float64))
        self.ys.append(float(y))

    def best(self) -> tuple[np.ndarray, float]:
        """The best point sampled so far and its score."""
        i = int(np.argmax(self.ys))
        return self.xs[i], self.ys[i]

    def suggest(self) -> np.ndarray:
        """The candidate with the largest expected improvement (not one already sampled)."""
        x = np.stack(self.xs)
        y = np.asarray(self.ys)
        gp = GaussianProcess(x, y, self.alpha)
        mu, sigma = gp.predict(self.candidates)
        ei = expected_improvement(mu, sigma, float(gp.y.max()))
        taken = ((self.candidates[:, None, :] - x[None, :, :]) ** 2).sum(-1).min(1) < 1e-10
        ei[taken] = -np.inf
        return self.candidates[int(np.argmax(ei))].copy()
