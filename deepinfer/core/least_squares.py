"""Non-negative least squares (Lawson–Hanson active set). Pure: numpy only.

The cost model's coefficients are seconds per FLOP, per byte, per request, per step: a negative
one would predict that more work takes less time, so they are fitted with x >= 0.
"""
from __future__ import annotations

import numpy as np


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray, *, max_iter: int | None = None
                              ) -> np.ndarray:
    """argmin_x ||a x - b||_2 subject to x >= 0.

    `a` is [rows, cols], `b` is [rows]. Columns are rescaled to unit norm internally, so
    features of very different magnitudes (FLOPs vs counts) are handled alike.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 1 or a.shape[0] != b.shape[0]:
        raise ValueError(f"shapes do not match: a {a.shape}, b {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("a and b must be finite")
    norms = np.linalg.norm(a, axis=0)
    scale = np.where(norms > 0, norms, 1.0)
    x = _lawson_hanson(a / scale, b, max_iter or 3 * a.shape[1] + 10)
    return np.where(norms > 0, x / scale, 0.0)


def _lawson_hanson(a: np.ndarray, b: np.ndarray, max_iter: int) -> np.ndarray:
    num_cols = a.shape[1]
    tol = 1e-10 * max(1.0, float(np.abs(a).max(initial=0.0)) * float(np.abs(b).max(initial=0.0)))
    x = np.zeros(num_cols)
    passive = np.zeros(num_cols, dtype=bool)
    gradient = a.T @ (b - a @ x)
    for _ in range(max_iter):
        candidates = ~passive & (gradient > tol)
        if not candidates.any():
            break
        passive[int(np.argmax(np.where(candidates, gradient, -np.inf)))] = True
        while True:
            s = _solve_on(a, b, passive)
            if (s[passive] > 0).all():
                break
            # Step from x towards s until the first passive coefficient hits zero.
            shrinking = passive & (s <= 0)
            alpha = float(np.min(x[shrinking] / (x[shrinking] - s[shrinking])))
            x = x + alpha * (s - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = s
        gradient = a.T @ (b - a @ x)
    return x


def _solve_on(a: np.ndarray, b: np.ndarray, passive: np.ndarray) -> np.ndarray:
    """Unconstrained least squares on the passive columns; zeros elsewhere."""
    s = np.zeros(a.shape[1])
    if passive.any():
        s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
    return s
