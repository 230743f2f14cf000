"""VTA's instruction set: 128-bit instructions and 32-bit micro-ops, encoded bit for bit.

The layouts are those of VTA's ``hw_spec.h``: C bit-fields of ``uint64_t`` (instructions)
and ``uint32_t`` (micro-ops), packed from the least significant bit in declaration order;
a field that would cross a 64-bit word starts at the next word (GCC's rule for
bit-fields of a 64-bit type). Little-endian: instruction word 0 is bytes 0..7.

Common head (every instruction)::

    opcode:3  pop_prev_dep:1  pop_next_dep:1  push_prev_dep:1  push_next_dep:1

LOAD/STORE (``VTAMemInsn``)::

    memory_type:3 sram_base:16 dram_base:32 | y_size:16 x_size:16 x_stride:16
    y_pad_0:4 y_pad_1:4 x_pad_0:4 x_pad_1:4

GEMM (``VTAGemInsn``), with U = log2(uop depth), A/I/W = log2(acc/inp/wgt depth)::

    reset_reg:1 uop_bgn:U uop_end:U+1 iter_out:14 iter_in:14 | dst_factor_out:A dst_factor_in:A
    src_factor_out:I src_factor_in:I wgt_factor_out:W wgt_factor_in:W

ALU (``VTAAluInsn``)::

    reset_reg:1 uop_bgn:U uop_end:U+1 iter_out:14 iter_in:14 | dst_factor_out:A dst_factor_in:A
    src_factor_out:A src_factor_in:A alu_opcode:3 use_imm:1 imm:16 (signed)

Micro-op (``VTAUop``, 32 bits)::

    dst_idx:A src_idx:S wgt_idx:W      S = max(A, I): accumulator index for ALU, input index for GEMM

For the default configuration (U=13, A=11, I=11, W=10) GEMM and ALU fill exactly 128 bits
and a micro-op exactly 32.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

import numpy as np

from .config import DEFAULT, VTAConfig
from .encoding import IMM_WIDTH, LOOP_ITER_WIDTH, check_layout, field_layouts  # noqa: F401 (re-exported)

# opcodes (hw_spec_const.h)
OP_LOAD, OP_STORE, OP_GEMM, OP_FINISH, OP_ALU = 0, 1, 2, 3, 4
OPCODE_NAMES = {OP_LOAD: "LOAD", OP_STORE: "STORE", OP_GEMM: "GEMM", OP_FINISH: "FINISH", OP_ALU: "ALU"}
# ALU opcodes
ALU_MIN, ALU_MAX, ALU_ADD, ALU_SHR, ALU_MUL = 0, 1, 2, 3, 4
ALU_NAMES = {ALU_MIN: "MIN", ALU_MAX: "MAX", ALU_ADD: "ADD", ALU_SHR: "SHR", ALU_MUL: "MUL"}
# memory types
MEM_UOP, MEM_WGT, MEM_INP, MEM_ACC, MEM_OUT, MEM_ACC_8BIT = 0, 1, 2, 3, 4, 5
MEM_NAMES = {MEM_UOP: "uop", MEM_WGT: "wgt", MEM_INP: "inp", MEM_ACC: "acc", MEM_OUT: "out", MEM_ACC_8BIT: "acc8"}

INSN_BYTES = 16


class ISAError(ValueError):
    """An instruction field does not fit its bit width, or bytes do not decode."""


# ---------------------------------------------------------------------- instructions
@dataclass(frozen=True)
class _Deps:
    pop_prev: bool = False
    pop_next: bool = False
    push_prev: bool = False
    push_next: bool = False


@dataclass(frozen=True)
class MemInsn(_Deps):
    """LOAD (``opcode=OP_LOAD``) or STORE (``OP_STORE``): a 2D strided DMA with padding.

    Addresses count elements of the buffer kind (``dram_base * elem_bytes`` is the byte
    address); SRAM receives ``(y_pad_0 + y_size + y_pad_1) x (x_pad_0 + x_size + x_pad_1)``
    contiguous elements, the pads zero."""

    opcode: int = OP_LOAD
    memory_type: int = MEM_INP
    sram_base: int = 0
    dram_base: int = 0
    y_size: int = 0
    x_size: int = 0
    x_stride: int = 0
    y_pad_0: int = 0
    y_pad_1: int = 0
    x_pad_0: int = 0
    x_pad_1: int = 0


@dataclass(frozen=True)
class _UopLoop(_Deps):
    """The fields GEMM and ALU share (the common head of ``VTAGemInsn`` and ``VTAAluInsn``):
    micro-ops ``[uop_bgn, uop_end)`` run in two nested loops whose indices add
    ``i_out * factor_out + i_in * factor_in`` to each micro-op's ``dst``/``src`` index."""

    reset_reg: bool = False
    uop_bgn: int = 0
    uop_end: int = 0
    iter_out: int = 1
    iter_in: int = 1
    dst_factor_out: int = 0
    dst_factor_in: int = 0
    src_factor_out: int = 0
    src_factor_in: int = 0


@dataclass(frozen=True)
class GemmInsn(_UopLoop):
    """``acc[dst] += inp[src] . wgt[wgt]^T`` over the micro-ops ``[uop_bgn, uop_end)`` in two
    nested loops (``reset_reg``: ``acc[dst] = 0`` instead)."""

    wgt_factor_out: int = 0
    wgt_factor_in: int = 0

    opcode = OP_GEMM


@dataclass(frozen=True)
class AluInsn(_UopLoop):
    """``acc[dst] = op(acc[dst], imm if use_imm else acc[src])`` over the micro-ops."""

    alu_opcode: int = ALU_ADD
    use_imm: bool = False
    imm: int = 0

    opcode = OP_ALU


@dataclass(frozen=True)
class FinishInsn(_Deps):
    """The end of a program: the host waits for it."""

    opcode = OP_FINISH


Insn = Union[MemInsn, GemmInsn, AluInsn, FinishInsn]


@dataclass(frozen=True)
class Uop:
    """A micro-op: base indices of one GEMM/ALU step."""

    dst_idx: int = 0
    src_idx: int = 0
    wgt_idx: int = 0


# ---------------------------------------------------------------------- layouts
@functools.lru_cache(maxsize=16)
def layouts(cfg: VTAConfig = DEFAULT) -> dict[str, list[tuple[str, int, int]]]:
    """Bit placement of every instruction kind and of the micro-op for ``cfg`` (cached; do not mutate)."""
    return field_layouts(cfg)


def _kind(insn: Insn) -> str:
    if isinstance(insn, MemInsn):
        return "mem"
    if isinstance(insn, GemmInsn):
        return "gemm"
    if isinstance(insn, AluInsn):
        return "alu"
    if isinstance(insn, FinishInsn):
        return "finish"
    raise ISAError(f"not a VTA instruction: {insn!r}")


def _pack(values: dict, fields: list[tuple[str, int, int]], what: str) -> int:
    word = 0
    for name, lsb, width in fields:
        v = int(values[name])
        if name == "imm":
            if not -(1 << (width - 1)) <= v < (1 << (width - 1)):
                raise ISAError(f"{what}: imm={v} does not fit a signed {width}-bit field")
            v &= (1 << width) - 1
        elif not 0 <= v < (1 << width):
            raise ISAError(f"{what}: {name}={v} does not fit an unsigned {width}-bit field")
        word |= v << lsb
    return word


def _unpack(word: int, fields: list[tuple[str, int, int]]) -> dict:
    out = {}
    for name, lsb, width in fields:
        v = (word >> lsb) & ((1 << width) - 1)
        if name == "imm" and v >= 1 << (width - 1):
            v -= 1 << width
        out[name] = v
    return out


def encode(insn: Insn, cfg: VTAConfig = DEFAULT) -> bytes:
    """The 16 bytes of one instruction."""
    kind = _kind(insn)
    values = {f.name: getattr(insn, f.name) for f in dataclasses.fields(insn)}
    values["opcode"] = insn.opcode
    if kind == "mem" and insn.opcode not in (OP_LOAD, OP_STORE):
        raise ISAError(f"memory instruction with opcode {insn.opcode}; expected LOAD (0) or STORE (1)")
    word = _pack(values, layouts(cfg)[kind], OPCODE_NAMES.get(insn.opcode, "?"))
    return word.to_bytes(INSN_BYTES, "little")


def decode(data: bytes, cfg: VTAConfig = DEFAULT) -> Insn:
    """The instruction in 16 bytes (inverse of :func:`encode`)."""
    if len(data) != INSN_BYTES:
        raise ISAError(f"a VTA instruction is {INSN_BYTES} bytes, got {len(data)}")
    word = int.from_bytes(bytes(data), "little")
    opcode = word & 0b111
    lay = layouts(cfg)
    if opcode in (OP_LOAD, OP_STORE):
        v = _unpack(word, lay["mem"])
        return MemInsn(**_bools(v))
    if opcode == OP_GEMM:
        v = _unpack(word, lay["gemm"])
        v.pop("opcode")
        return GemmInsn(**_bools(v))
    if opcode == OP_ALU:
        v = _unpack(word, lay["alu"])
        v.pop("opcode")
        return AluInsn(**_bools(v))
    if opcode == OP_FINISH:
        v = _unpack(word, lay["finish"])
        v.pop("opcode")
        return FinishInsn(**_bools(v))
    raise ISAError(f"unknown VTA opcode {opcode}")


def _bools(v: dict) -> dict:
    for k in ("pop_prev", "pop_next", "push_prev", "push_next", "reset_reg", "use_imm"):
        if k in v:
            v[k] = bool(v[k])
    return v


def encode_stream(insns: Iterable[Insn], cfg: VTAConfig = DEFAULT) -> np.ndarray:
    """Instructions as one ``uint8`` array of ``16 * n`` bytes (what VTA fetches)."""
    return np.frombuffer(b"".join(encode(i, cfg) for i in insns), dtype=np.uint8).copy()


def decode_stream(data: Union[bytes, np.ndarray], cfg: VTAConfig = DEFAULT) -> list[Insn]:
    raw = bytes(np.asarray(data, dtype=np.uint8).tobytes()) if not isinstance(data, bytes) else data
    if len(raw) % INSN_BYTES:
        raise ISAError(f"an instruction stream is a multiple of {INSN_BYTES} bytes, got {len(raw)}")
    return [decode(raw[k : k + INSN_BYTES], cfg) for k in range(0, len(raw), INSN_BYTES)]


def encode_uops(uops: Iterable[Uop], cfg: VTAConfig = DEFAULT) -> np.ndarray:
    """Micro-ops as ``uint32`` words (little-endian in DRAM)."""
    fields = layouts(cfg)["uop"]
    return np.array([_pack(dataclasses.asdict(u), fields, "uop") for u in uops], dtype="<u4")


def encode_uop_arrays(dst: np.ndarray, src: np.ndarray, wgt: np.ndarray, cfg: VTAConfig = DEFAULT) -> np.ndarray:
    """Vectorised :func:`encode_uops` for index arrays (the code generator's path)."""
    (_, l0, w0), (_, l1, w1), (_, l2, w2) = layouts(cfg)["uop"]
    out = np.zeros(len(dst), dtype=np.uint64)
    for arr, lsb, width, name in ((dst, l0, w0, "dst_idx"), (src, l1, w1, "src_idx"), (wgt, l2, w2, "wgt_idx")):
        arr = np.asarray(arr, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= 1 << width):
            raise ISAError(f"uop: {name} out of the {width}-bit range (max {int(arr.max())})")
        out |= arr.astype(np.uint64) << np.uint64(lsb)
    return out.astype("<u4")


def decode_uops(words: np.ndarray, cfg: VTAConfig = DEFAULT) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dst_idx, src_idx, wgt_idx)`` arrays of ``uint32`` micro-op words."""
    w = np.asarray(words, dtype=np.uint32).astype(np.int64)
    return tuple((w >> lsb) & ((1 << width) - 1) for _, lsb, width in layouts(cfg)["uop"])  # type: ignore[return-value]


def module_of(insn: Insn) -> str:
    """The VTA module that executes ``insn``: ``load``, ``compute`` or ``store``.

    LOADs into the input and weight buffers run on the load module; LOADs of micro-ops
    and accumulators, GEMM, ALU and FINISH on the compute module; STOREs on the store module."""
    if isinstance(insn, MemInsn):
        if insn.opcode == OP_STORE:
            return "store"
        return "load" if insn.memory_type in (MEM_INP, MEM_WGT) else "compute"
    return "compute"


def describe(insn: Insn) -> str:
    """One line for listings (``vta.isa.describe``)."""
    deps = "".join(c for c, f in (("p<", insn.pop_prev), ("p>", insn.pop_next), ("P<", insn.push_prev), ("P>", insn.push_next)) if f)
    if isinstance(insn, MemInsn):
        pads = f" pad y{insn.y_pad_0},{insn.y_pad_1} x{insn.x_pad_0},{insn.x_pad_1}"
        return (
            f"{OPCODE_NAMES[insn.opcode]} {MEM_NAMES.get(insn.memory_type, insn.memory_type)} sram={insn.sram_base} "
            f"dram={insn.dram_base} {insn.y_size}x{insn.x_size}/{insn.x_stride}{pads} {deps}"
        ).rstrip()
    if isinstance(insn, (GemmInsn, AluInsn)):
        name = "GEMM" if isinstance(insn, GemmInsn) else f"ALU {ALU_NAMES.get(insn.alu_opcode, insn.alu_opcode)}"
        extra = f" imm={insn.imm}" if isinstance(insn, AluInsn) and insn.use_imm else ""
        reset = " reset" if insn.reset_reg else ""
        return f"{name}{reset} uop[{insn.uop_bgn}:{insn.uop_end}] {insn.iter_out}x{insn.iter_in}{extra} {deps}".rstrip()
    return f"FINISH {deps}".rstrip()


def elem_bytes_of(memory_type: int, cfg: VTAConfig = DEFAULT) -> int:
    """Bytes of one DRAM element a LOAD/STORE of ``memory_type`` addresses (``acc8``: input-sized)."""
    return {
        MEM_UOP: cfg.uop_elem_bytes,
        MEM_WGT: cfg.wgt_elem_bytes,
        MEM_INP: cfg.inp_elem_bytes,
        MEM_ACC: cfg.acc_elem_bytes,
        MEM_OUT: cfg.out_elem_bytes,
        MEM_ACC_8BIT: cfg.inp_elem_bytes,
    }[memory_type]


def relocate(insns: Sequence[Insn], base_bytes: int, cfg: VTAConfig = DEFAULT) -> list[Insn]:
    """The program with its DRAM image moved to byte address ``base_bytes`` (what a board
    driver does after allocating the image in physically contiguous memory)."""
    out = []
    for insn in insns:
        if isinstance(insn, MemInsn):
            eb = elem_bytes_of(insn.memory_type, cfg)
            if base_bytes % eb:
                raise ISAError(f"relocation base {base_bytes} is not a multiple of the {MEM_NAMES[insn.memory_type]} element ({eb} bytes)")
            insn = dataclasses.replace(insn, dram_base=insn.dram_base + base_bytes // eb)
        out.append(insn)
    return out
