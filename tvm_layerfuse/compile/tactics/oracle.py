"""What the oneDNN rewrites ask the library while they run: which kernel a layer gets on this
machine, how long a conv takes under two sets of attrs, and the block width of the blocked
layout its optimised kernels take here.

:class:`LibraryOracle` asks the library loaded in this process (the default). A test gives
:class:`.use_onednn.UseOneDNNConv` an oracle of its own (any object with these five methods),
so the rewrites run, and their IR can be compared before and after, where oneDNN is absent.
The steps of the pass read the oracle of the running pass through :func:`current_oracle`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Protocol, Sequence

from . import abi


class Oracle(Protocol):
    def block_width(self) -> int:
        """The channel block of oneDNN's optimised kernels here: 16 (AVX-512), 8 (AVX2), 0 (plain)."""

    def conv_kernel(self, x_shape: Sequence[int], w_shape: Sequence[int], attrs: abi.ConvAttrs, *, residual: bool) -> str:
        """The kernel name (``impl_info_str``) of the conv; ``ref...`` / ``unsupported...``: none optimised."""

    def time_conv(
        self, x_shape: Sequence[int], w_shape: Sequence[int], a: abi.ConvAttrs, b: abi.ConvAttrs, *, residual: bool, threads: int = 1
    ) -> tuple[float, float]:
        """The conv's time (ms) under attrs ``a`` and ``b`` on ``threads`` threads."""

    def pool_kernel(self, x_shape: Sequence[int], y_shape: Sequence[int], attrs: abi.PoolAttrs) -> str:
        """The kernel name of the pooling layer."""

    def dense_kernel(self, n: int, k: int, m: int) -> str:
        """The kernel name of ``x [n, k] @ w [k, m]``."""


class LibraryOracle:
    """The oneDNN tactic library of this process (built and loaded on first use).

    Timings are kept for the life of the process (``_TIMINGS``, as TensorRT's timing cache):
    a layer shape is timed once, and every later compile in the process that meets it again
    makes the same choice without timing it again."""

    def __init__(self) -> None:
        from . import onednn

        onednn.load()
        self._onednn = onednn

    def block_width(self):
        return self._onednn.block_width()

    def conv_kernel(self, x_shape, w_shape, attrs, *, residual):
        return self._onednn.implementation(x_shape, w_shape, attrs, residual=residual)

    def time_conv(self, x_shape, w_shape, a, b, *, residual, threads=1):
        key = (tuple(x_shape), tuple(w_shape), tuple(a.values()), tuple(b.values()), bool(residual), int(threads))
        if key not in _TIMINGS:
            _TIMINGS[key] = self._onednn.time_conv(x_shape, w_shape, a, b, residual=residual, threads=threads)
        return _TIMINGS[key]

    def pool_kernel(self, x_shape, y_shape, attrs):
        return self._onednn.pool_implementation(x_shape, y_shape, attrs)

    def dense_kernel(self, n, k, m):
        return self._onednn.dense_implementation(n, k, m)


# (x, w, attrs a, attrs b, residual, threads) -> (ms under a, ms under b): LibraryOracle.time_conv's answers
_TIMINGS: dict[tuple, tuple[float, float]] = {}

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("layerfuse_onednn_oracle", default=None)


@contextlib.contextmanager
def use_oracle(oracle: Oracle) -> Iterator[Oracle]:
    token = _CURRENT.set(oracle)
    try:
        yield oracle
    finally:
        _CURRENT.reset(token)


def current_oracle() -> Oracle:
    """The oracle of the running pass, else the library's."""
    oracle = _CURRENT.get()
    if oracle is None:
        oracle = LibraryOracle()
        _CURRENT.set(oracle)
    return oracle
