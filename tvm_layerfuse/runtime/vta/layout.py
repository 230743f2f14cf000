"""VTA's blocked activation and weight layouts, with channel maps for in-place concats.

An activation tensor ``[1, C, H, W]`` lives in DRAM as ``[CB, H, W, BLOCK]`` int8: channel
block ``cb``, pixel ``(h, w)``, lane ``c % BLOCK``; one ``(cb, h, w)`` is one VTA input
element. A tensor may be a *view*: blocks ``[offset, offset + CB)`` of a root buffer (a
producer that stores into a concat block). Channel counts that are not multiples of the
block are padded per *segment*: a concat of a 24- and an 8-channel tensor has segments
``(0, 24) -> phys 0`` and ``(24, 8) -> phys 32``, 3 blocks; consumers' weights are
scattered to the same physical channels, the pad channels hold zeros.

Weights of a conv are ``[OB, IB, kh, kw, BLOCK_OUT, BLOCK_IN]`` int8 (one element = one
16 x 16 block, VTA's ``wgt`` element, row = output lane).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Segment:
    logical: int  # first logical channel
    count: int
    phys: int  # first physical channel (a multiple of the block)


@dataclass
class Layout:
    channels: int
    blocks: int
    segments: tuple[Segment, ...]

    @staticmethod
    def dense(channels: int, block: int) -> "Layout":
        return Layout(channels, -(-channels // block), (Segment(0, channels, 0),))

    @staticmethod
    def concat(parts: Sequence["Layout"], block: int) -> "Layout":
        segs, logical, phys = [], 0, 0
        for p in parts:
            for s in p.segments:
                segs.append(Segment(logical + s.logical, s.count, phys * block + s.phys))
            logical += p.channels
            phys += p.blocks
        return Layout(logical, phys, tuple(segs))

    def phys_index(self) -> np.ndarray:
        """Physical channel of each logical channel."""
        idx = np.zeros(self.channels, dtype=np.int64)
        for s in self.segments:
            idx[s.logical : s.logical + s.count] = s.phys + np.arange(s.count)
        return idx

    def same_as(self, other: "Layout") -> bool:
        return self.channels == other.channels and self.blocks == other.blocks and self.segments == other.segments


def pack_activation(x: np.ndarray, layout: Layout, block: int) -> np.ndarray:
    """``[1, C, H, W]`` int8 -> ``[CB, H, W, block]`` int8 (pad channels zero)."""
    _, c, h, w = x.shape
    phys = np.zeros((layout.blocks * block, h, w), dtype=np.int8)
    phys[layout.phys_index()] = x[0]
    return np.ascontiguousarray(phys.reshape(layout.blocks, block, h, w).transpose(0, 2, 3, 1))


def unpack_activation(blocked: np.ndarray, layout: Layout) -> np.ndarray:
    """``[CB, H, W, block]`` -> ``[1, C, H, W]``."""
    cb, h, w, block = blocked.shape
    phys = blocked.transpose(0, 3, 1, 2).reshape(cb * block, h, w)
    return phys[layout.phys_index()][None]


def pack_weight(w_phys: np.ndarray, block: int) -> np.ndarray:
    """``[OB*block, IB*block, kh, kw]`` -> ``[OB, IB, kh, kw, block_out, block_in]``."""
    co, ci, kh, kw = w_phys.shape
    return np.ascontiguousarray(w_phys.reshape(co // block, block, ci // block, block, kh, kw).transpose(0, 2, 4, 5, 1, 3))
