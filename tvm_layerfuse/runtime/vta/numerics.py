"""The integer arithmetic shared by the compiler, the numpy reference and the runtime."""

from __future__ import annotations

import numpy as np


def quantize(x: np.ndarray, f: int) -> np.ndarray:
    """``clamp(floor(x * 2**f + 1/2), -128, 127)`` as int8."""
    return np.clip(np.floor(np.asarray(x, dtype=np.float64) * 2.0**f + 0.5), -128, 127).astype(np.int8)


def dequantize(q: np.ndarray, f: int) -> np.ndarray:
    return q.astype(np.float64) * 2.0**-f


def shift_round(acc: np.ndarray, shift) -> np.ndarray:
    """VTA's SHR: arithmetic right shift, left for negative amounts (int64; ``shift`` a
    scalar or an array broadcast against ``acc``)."""
    shift = np.asarray(shift, dtype=np.int64)
    return np.where(shift >= 0, acc >> np.maximum(shift, 0), acc << np.maximum(-shift, 0))
