"""Bit placement of VTA's instruction and micro-op fields (``hw_spec.h``), from a configuration.

Kept apart from :mod:`tvm_layerfuse.runtime.vta.isa` so that validating a configuration
(:mod:`tvm_layerfuse.runtime.vta.config`) can check that its fields fit without importing the ISA.
``cfg`` is any object with the ``log_*_depth`` properties of :class:`~tvm_layerfuse.runtime.vta.config.VTAConfig`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

LOOP_ITER_WIDTH = 14
IMM_WIDTH = 16
_HEAD = [("opcode", 3), ("pop_prev", 1), ("pop_next", 1), ("push_prev", 1), ("push_next", 1)]


def _place(fields: Sequence[tuple[str, int]], unit: int) -> list[tuple[str, int, int]]:
    """``(name, lsb, width)`` of C bit-fields of a ``unit``-bit integer type."""
    out, pos = [], 0
    for name, width in fields:
        if pos // unit != (pos + width - 1) // unit:  # would straddle a storage unit
            pos = (pos // unit + 1) * unit
        out.append((name, pos, width))
        pos += width
    return out


def field_layouts(cfg: Any) -> dict[str, list[tuple[str, int, int]]]:
    """Bit placement of every instruction kind and of the micro-op for ``cfg``."""
    u, a, i, w = cfg.log_uop_depth, cfg.log_acc_depth, cfg.log_inp_depth, cfg.log_wgt_depth
    loop = [("reset_reg", 1), ("uop_bgn", u), ("uop_end", u + 1), ("iter_out", LOOP_ITER_WIDTH), ("iter_in", LOOP_ITER_WIDTH)]
    mem = [("memory_type", 3), ("sram_base", 16), ("dram_base", 32), ("y_size", 16), ("x_size", 16), ("x_stride", 16)]
    mem += [("y_pad_0", 4), ("y_pad_1", 4), ("x_pad_0", 4), ("x_pad_1", 4)]
    gemm = loop + [("dst_factor_out", a), ("dst_factor_in", a), ("src_factor_out", i), ("src_factor_in", i)]
    gemm += [("wgt_factor_out", w), ("wgt_factor_in", w)]
    alu = loop + [("dst_factor_out", a), ("dst_factor_in", a), ("src_factor_out", a), ("src_factor_in", a)]
    alu += [("alu_opcode", 3), ("use_imm", 1), ("imm", IMM_WIDTH)]
    return {
        "mem": _place(_HEAD + mem, 64),
        "gemm": _place(_HEAD + gemm, 64),
        "alu": _place(_HEAD + alu, 64),
        "finish": _place(_HEAD, 64),
        "uop": _place([("dst_idx", a), ("src_idx", max(a, i)), ("wgt_idx", w)], 32),
    }


def check_layout(cfg: Any) -> Optional[str]:
    """Why ``cfg``'s fields do not fit VTA's 128-bit instruction / 32-bit micro-op, or None."""
    for kind, fields in field_layouts(cfg).items():
        name, lsb, width = fields[-1]
        limit = 32 if kind == "uop" else 128
        if lsb + width > limit:
            return f"the {kind} encoding needs {lsb + width} bits, more than VTA's {limit}"
    return None
