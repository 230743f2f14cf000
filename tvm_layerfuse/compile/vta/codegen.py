"""Compile-time instruction generation: each VTA op of the quantized graph -> one VTA program.

Static shapes make every address known at compile time, so the generator lays out one
DRAM image (packed weights, biases, micro-op kernels, activation buffers; see
:mod:`tvm_layerfuse.runtime.vta.layout`) and emits instructions with absolute element addresses.

A conv (:class:`ConvOp`) is tiled over output rows (``oht`` rows) and output-channel blocks
(``obc`` blocks) so that its input rows with halo, its weights, its accumulators (tile and
per-channel vectors) and its micro-ops fit the on-chip buffers; the loop order (channel
chunks outside or row tiles outside) is the one that moves fewer DRAM bytes. When even one
output block with all input blocks does not fit, the reduction is split into chunks of
``ibc`` input blocks, the accumulators staying on chip across them. Each step::

    load:    LOAD wgt (when the chunk changes; the identity block once, with a residual)
             LOAD inp per input block (y/x padding by the DMA; one 2D transfer when whole
             blocks are loaded)   LOAD inp of the residual tile (with a residual)
    compute: LOAD uop (once)
             LOAD acc [bias | shift parts | residual shift parts] vectors (when the chunk changes)
             GEMM reset   (with a residual: GEMM identity (acc += res) + ALU SHR parts (align))
             GEMM  (uops (oy, ib, i, j); loops: out = output block, in = output column)
             ALU ADD bias   ALU SHR parts (requantize, per channel)   ALU MAX/MIN (ReLU, Clip, int8 range)
    store:   STORE per output segment (a horizontal merge's branches, concat offsets)

Dependency tokens follow one protocol per step ``t``: the last load pushes load->compute and
the first compute instruction pops it; when step ``t+1`` loads, step ``t``'s last GEMM pushes
compute->load (its inputs and weights may be overwritten); a step that stores pushes
compute->store from its last compute instruction, popped by its first store, whose last
instruction pushes store->compute, popped by the next compute step (the accumulators may be
overwritten) or by FINISH. Every pushed token is popped (the simulator checks this and every
cross-module hazard).

Only what both VTA hardware designs execute is emitted (the simulator's hardware mode checks
it): int8 data reaches the accumulators as an ``inp`` tile through a GEMM with an identity
weight block (VTA has no int8 accumulator load on hardware), every stored element was last
written by a GEMM or ALU instruction (the hardware stores from the output buffer they write),
and every shift is split into SHR instructions of at most 15 right or 16 left, with all lanes
of a vector SHR of one sign and a negative immediate for left shifts (:func:`shift_parts`).

Element-wise programs (the unfused residual add / activation) and concat copies::

    load:    LOAD wgt identity (once)   LOAD inp of each input chunk
    compute: GEMM reset   GEMM identity per input, SHR (left) between them (Horner: align the
             inputs to the common scale)   SHR / ADD rounding / SHR   MAX/MIN
    store:   STORE
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ...runtime.vta import isa
from ...runtime.vta.config import DEFAULT, VTAConfig
from ...runtime.vta.layout import Layout, pack_weight
from ...runtime.vta.sim import DRAM
from .graph import ConcatOp, ConvOp, EltwiseOp, VTAGraph
from .quantize import Quantization, int_conv, int_eltwise

log = logging.getLogger(__name__)


@dataclass
class Storage:
    """Where a VTA-domain tensor lives: blocks ``[offset, offset + layout.blocks)`` of ``root``."""

    root: str
    offset: int
    layout: Layout
    height: int
    width: int
    base: int = -1  # element index (16-byte units) of the root buffer in DRAM

    @property
    def elem(self) -> int:
        """DRAM element index of this tensor's first element."""
        return self.base + self.offset * self.height * self.width


@dataclass
class Program:
    """One VTA program (one fused layer) and what it was made from."""

    op: str
    insns: list
    kind: str
    tiling: dict = field(default_factory=dict)

    def encoded(self, cfg: VTAConfig) -> np.ndarray:
        return isa.encode_stream(self.insns, cfg)


# ---------------------------------------------------------------------- storage
def plan_storage(graph: VTAGraph, cfg: VTAConfig = DEFAULT) -> dict[str, Storage]:
    """Layouts and views of every tensor a VTA op reads or writes (concats in place)."""
    block = cfg.block
    vta_tensors: set[str] = set()
    for op in graph.ops:
        if op.on_vta:
            vta_tensors.update(op.reads)
            vta_tensors.update(op.writes)
    storage: dict[str, Storage] = {}

    def dense(name: str) -> Storage:
        _, c, h, w = graph.shapes[name]
        return Storage(name, 0, Layout.dense(c, block), h, w)

    for op in graph.ops:
        if isinstance(op, ConcatOp) and op.on_vta:
            parts = []
            for name in op.inputs:
                if name not in storage:
                    storage[name] = dense(name)
                parts.append(storage[name].layout)
            _, _, h, w = graph.shapes[op.output]
            storage[op.output] = Storage(op.output, 0, Layout.concat(parts, block), h, w)
            views_ok = op.in_place and len(set(op.inputs)) == len(op.inputs) and all(
                storage[n].root == n and n not in graph.inputs for n in op.inputs
            )
            if op.in_place and not views_ok:
                op.in_place = False
                op.reason = "inputs cannot be views of the concat block; copied"
            if op.in_place:
                offset = 0
                for name in op.inputs:
                    _rebase(storage, name, op.output, offset)
                    offset += storage[name].layout.blocks
        else:
            for name in op.writes + op.reads:
                if name in vta_tensors and name not in storage and len(graph.shapes.get(name, ())) == 4:
                    storage[name] = dense(name)
    return storage


def _rebase(storage: dict[str, Storage], name: str, root: str, offset: int) -> None:
    """Make ``name`` (and every view of it) a view of ``root`` at block ``offset``."""
    for s in storage.values():
        if s.root == name:
            s.offset += offset
            s.root = root


# ---------------------------------------------------------------------- feasibility
SHR_RIGHT_MAX, SHR_LEFT_MAX = 15, 16
"""The longest shift one SHR makes on both hardware designs (the FPGA design's signed 5-bit amount)."""

MAX_VECTORS = 7
"""Per-channel accumulator vectors of a conv: bias, up to 3 requantization and 3 residual shift parts
(the quantizer keeps shifts in -16..30 and residual alignments in -15..30)."""


def shift_parts(amount: np.ndarray) -> list[tuple[np.ndarray, bool]]:
    """Per-lane SHR amounts (negative: left) as SHR instructions both hardware designs run:
    ``[(amounts, left)]``, each lane within -16..15, one sign per instruction (``left``: the
    immediate's sign bit the Chisel design reads). Shifts by floor compose, so the parts
    applied in any order equal the whole shift."""
    right, left = np.maximum(amount, 0).astype(np.int64), np.maximum(-amount, 0).astype(np.int64)
    parts = []
    while right.any():
        a = np.minimum(right, SHR_RIGHT_MAX)
        parts.append((a, False))
        right = right - a
    while left.any():
        a = np.minimum(left, SHR_LEFT_MAX)
        parts.append((-a, True))
        left = left - a
    return parts


def imm_shift_parts(amount: int) -> list[int]:
    """One SHR amount (negative: left) as immediates within -16..15."""
    return [int(a[0]) for a, _ in shift_parts(np.array([amount]))]


@dataclass
class ConvTiling:
    obc: int  # output blocks per chunk
    oht: int  # output rows per tile
    chunk_outer: bool
    ib: int
    ob: int
    ibc: int  # input blocks per reduction chunk (ib: no split)
    kh: int
    kw: int
    wt: int  # padded input width in SRAM
    ht: int  # input rows per tile in SRAM (with halo)
    res: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def conv_tiling(op: ConvOp, storage: dict[str, Storage], shapes, cfg: VTAConfig, *,
                n_vec: Optional[int] = None) -> tuple[Optional[ConvTiling], Optional[str]]:
    """The cheapest tiling that fits the buffers (with ``n_vec`` per-channel vectors beside the
    accumulator tile; a residual adds its int8 tile to the input buffer and an identity block
    to the weight buffer), or the reason none does. ``n_vec`` None: the most a conv may need
    (before quantization decides the shifts)."""
    inp = storage[op.input]
    ib = inp.layout.blocks
    ob = sum(storage[s.tensor].layout.blocks for s in op.outputs)
    _, _, kh, kw = op.weight.shape
    (sh, sw), (_, pl, _, pr) = op.strides, op.pads
    if sh != sw:
        return None, f"unequal strides {op.strides}"
    s = sh
    h, w = inp.height, inp.width
    _, _, oh, ow = shapes[op.outputs[0].tensor]
    wt = w + pl + pr
    kk = kh * kw
    res = int(op.residual is not None)
    if n_vec is None:
        n_vec = MAX_VECTORS if res else MAX_VECTORS - 3  # without a residual: no alignment parts
    best, best_cost = None, None
    for ibc in range(ib, 0, -1):  # split the reduction over input blocks only when nothing else fits
        split = ibc < ib
        for obc in range(min(ob, (cfg.wgt_depth - res) // (ibc * kk)), 0, -1):
            lim_acc = (cfg.acc_depth - n_vec * obc) // (obc * ow)  # tile + per-channel vectors
            # input rows with halo, and the residual tile: ibc*((oht-1)*s + kh)*wt + res*obc*oht*ow <= depth
            lim_inp = max((cfg.inp_depth - ibc * (kh - s) * wt) // (ibc * s * wt + res * obc * ow), 0)
            while lim_inp > 0 and ibc * ((lim_inp - 1) * s + kh) * wt + res * obc * lim_inp * ow > cfg.inp_depth:
                lim_inp -= 1
            n_alu = 1 + n_vec + res  # ALU uops (tile, one per vector) and the identity GEMM's
            lim_uop = (cfg.uop_depth - n_alu) // ((2 if split else 1) * ibc * kk)  # a second kernel for the last chunk
            oht = min(oh, lim_acc, lim_inp, lim_uop, ((1 << isa.LOOP_ITER_WIDTH) - 1) // max(ow, 1))  # iter_in field
            if oht < 1:
                continue
            tiles, chunks = -(-oh // oht), -(-ob // obc)
            inp_bytes = ib * h * w * cfg.inp_elem_bytes  # one pass over the input
            halo = ib * max(kh - s, 0) * w * cfg.inp_elem_bytes * (tiles - 1)  # rows loaded twice at tile seams
            wgt_bytes = ob * ib * kk * cfg.wgt_elem_bytes
            if split:  # every (chunk, tile) reloads its inputs and weights
                costs = [(True, (inp_bytes + halo) * chunks + wgt_bytes * tiles)]
            else:
                costs = [(True, wgt_bytes + (inp_bytes + halo) * (chunks if tiles > 1 else 1)),
                         (False, inp_bytes + halo + wgt_bytes * (tiles if chunks > 1 else 1))]
            for chunk_outer, cost in costs:
                key = (cost, tiles * chunks)
                if best_cost is None or key < best_cost:
                    ht = (oht - 1) * s + kh
                    best, best_cost = ConvTiling(obc, oht, chunk_outer, ib, ob, ibc, kh, kw, wt, ht, res), key
        if best is not None:
            break
    if best is None:
        return None, f"one input block x {kh}x{kw} kernel rows at width {w} do not fit the on-chip buffers"
    return best, None


def prepare(graph: VTAGraph, cfg: VTAConfig = DEFAULT) -> dict[str, Storage]:
    """Decide what VTA runs (marks the rest host with a reason) and plan the storage."""
    for name in graph.inputs:
        if graph.shapes.get(name, (1,))[0] != 1:
            from ...errors import ShapeError

            raise ShapeError(
                f"input {name!r} has batch {graph.shapes[name][0]}; expected batch {cfg.batch} (VTA's configuration) - "
                "compile with batch 1 (--input-shape) and run images one by one"
            )
    for op in graph.ops:
        if op.on_vta and any(len(graph.shapes.get(t, ())) != 4 for t in op.reads + op.writes):
            op.on_vta, op.reason = False, "not a 4-D activation"
    storage = plan_storage(graph, cfg)
    for op in graph.ops:
        if isinstance(op, ConvOp) and op.on_vta:
            _, reason = conv_tiling(op, storage, graph.shapes, cfg)
            if reason is None and op.residual is not None:
                out = storage[op.outputs[0].tensor].layout
                if len(op.outputs) != 1 or not storage[op.residual].layout.same_as(out):
                    reason = "the residual's channel layout differs from the output's"
            if reason:
                op.on_vta, op.reason = False, reason
        elif isinstance(op, EltwiseOp) and op.on_vta:
            lay = storage[op.output].layout
            if not all(storage[n].layout.same_as(lay) for n in op.inputs):
                op.on_vta, op.reason = False, "inputs and output have different channel layouts"
    return plan_storage(graph, cfg)


# ---------------------------------------------------------------------- program assembly
class _Steps:
    """Instructions grouped in steps; :meth:`finish` sets the dependency flags (module doc)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def new(self) -> dict:
        step = {"load": [], "compute": [], "store": [], "release": None}
        self.steps.append(step)
        return step

    def finish(self) -> list:
        flags: dict[int, dict[str, bool]] = {}
        flat: list = []
        index: list[dict[str, list[int]]] = []
        for step in self.steps:
            pos = {}
            for part in ("load", "compute", "store"):
                pos[part] = list(range(len(flat), len(flat) + len(step[part])))
                flat.extend(step[part])
            pos["release"] = pos["compute"][step["release"]] if step["release"] is not None else pos["compute"][-1]
            index.append(pos)

        def set_flag(k: int, name: str) -> None:
            flags.setdefault(k, {})[name] = True

        n = len(self.steps)
        pending_store = False  # a store step whose store->compute token no compute step popped yet
        for t, pos in enumerate(index):
            if not pos["compute"]:
                raise ValueError("every step needs compute instructions")
            if pos["load"]:
                if t > 0:
                    set_flag(pos["load"][0], "pop_next")
                set_flag(pos["load"][-1], "push_next")
                set_flag(pos["compute"][0], "pop_prev")
            if pending_store:
                set_flag(pos["compute"][0], "pop_next")
                pending_store = False
            if t + 1 < n and index[t + 1]["load"]:
                set_flag(pos["release"], "push_prev")
            if pos["store"]:
                set_flag(pos["compute"][-1], "push_next")
                set_flag(pos["store"][0], "pop_prev")
                set_flag(pos["store"][-1], "push_prev")
                pending_store = True
        out = [dataclasses.replace(insn, **flags[k]) if k in flags else insn for k, insn in enumerate(flat)]
        out.append(isa.FinishInsn(pop_next=pending_store))
        return out


def _alu(opcode: int, uop: int, iter_out: int, iter_in: int, *, dst_out=0, dst_in=1, src_out=0, src_in=0, imm=None, left=False):
    """One ALU instruction; ``imm=None``: vector mode (``left``: a vector SHR of left shifts, whose
    negative immediate tells the Chisel design so)."""
    return isa.AluInsn(
        uop_bgn=uop, uop_end=uop + 1, iter_out=iter_out, iter_in=iter_in, dst_factor_out=dst_out, dst_factor_in=dst_in,
        src_factor_out=src_out, src_factor_in=src_in, alu_opcode=opcode, use_imm=imm is not None,
        imm=int(imm) if imm is not None else (-1 if left else 0),
    )


def _blocks_dma(opcode: int, mem: int, dram: list[int], sram0: int, sram_stride: int, n: int, dram_stride: int) -> list:
    """DMA of ``n`` elements for each block (SRAM ``sram0 + k*sram_stride``, DRAM ``dram[k]``):
    one 2D transfer per run of blocks ``dram_stride`` apart when the SRAM rows are dense."""
    out, k = [], 0
    while k < len(dram):
        run = 1
        if sram_stride == n and dram_stride < (1 << 16):  # x_stride is a 16-bit field
            while k + run < len(dram) and dram[k + run] == dram[k] + run * dram_stride:
                run += 1
        if run > 1:
            out.append(isa.MemInsn(opcode=opcode, memory_type=mem, sram_base=sram0 + k * sram_stride, dram_base=dram[k],
                                   y_size=run, x_size=n, x_stride=dram_stride))
        else:
            out.append(isa.MemInsn(opcode=opcode, memory_type=mem, sram_base=sram0 + k * sram_stride, dram_base=dram[k],
                                   y_size=1, x_size=n, x_stride=n))
        k += run
    return out


def _epilogue_tail(step: dict, uop: int, iter_out: int, iter_in: int, dst_out: int, shift: int, lo: int, hi: int) -> None:
    for a in imm_shift_parts(shift):
        step["compute"].append(_alu(isa.ALU_SHR, uop, iter_out, iter_in, dst_out=dst_out, imm=a))
    step["compute"].append(_alu(isa.ALU_MAX, uop, iter_out, iter_in, dst_out=dst_out, imm=lo))
    step["compute"].append(_alu(isa.ALU_MIN, uop, iter_out, iter_in, dst_out=dst_out, imm=hi))


class Compiler:
    """Lay out DRAM and generate a program for every VTA op of ``graph``."""

    def __init__(self, graph: VTAGraph, q: Quantization, storage: dict[str, Storage], cfg: VTAConfig = DEFAULT) -> None:
        self.graph, self.q, self.storage, self.cfg = graph, q, storage, cfg
        self.dram = DRAM()
        self.regions: dict[str, tuple[int, int]] = {}  # name -> (byte address, bytes)
        self.programs: dict[str, Program] = {}

    def _region(self, name: str, array: np.ndarray, elem_bytes: int) -> int:
        addr = self.dram.alloc(array.nbytes, align=max(256, elem_bytes))
        self.dram.write(addr, array)
        self.regions[name] = (addr, int(array.nbytes))
        return addr // elem_bytes

    def compile(self) -> "Compiler":
        eb = self.cfg.inp_elem_bytes
        for name, s in self.storage.items():
            if s.root == name:
                nbytes = s.layout.blocks * s.height * s.width * eb
                s.base = self._region(f"act:{name}", np.zeros(nbytes, np.uint8), eb)
        for s in self.storage.values():
            s.base = self.storage[s.root].base
        for op in self.graph.ops:
            if not op.on_vta:
                continue
            if isinstance(op, ConvOp):
                self.programs[op.name] = self._conv(op)
            elif isinstance(op, EltwiseOp):
                self.programs[op.name] = self._eltwise(op)
            elif isinstance(op, ConcatOp) and not op.in_place:
                self.programs[op.name] = self._copy(op)
        return self

    # ------------------------------------------------------------------ conv
    def _identity(self) -> int:
        """DRAM element of an identity weight block (``acc += inp . I``: int8 data into the accumulators)."""
        if "wgt:identity" not in self.regions:
            eye = np.eye(self.cfg.block, dtype=np.int8).reshape(self.cfg.block, self.cfg.block, 1, 1)
            self._identity_base = self._region("wgt:identity", pack_weight(eye, self.cfg.block), self.cfg.wgt_elem_bytes)
        return self._identity_base

    def _conv(self, op: ConvOp) -> Program:
        cfg, block = self.cfg, self.cfg.block
        p = int_conv(op, self.q)
        inp = self.storage[op.input]
        # physical weights and bias: output rows per segment block-aligned, input columns per layout
        seg_blocks = [self.storage[s.tensor].layout.blocks for s in op.outputs]
        co_phys, ci_phys = sum(seg_blocks) * block, inp.layout.blocks * block
        _, _, kh, kw = op.weight.shape
        w_phys = np.zeros((co_phys, ci_phys, kh, kw), np.int8)  # [OB*16, IB*16, kh, kw]
        b_phys = np.zeros(co_phys, np.int64)
        shift_phys = np.zeros(co_phys, np.int64)
        rshift_phys = np.zeros(co_phys, np.int64)
        cols = inp.layout.phys_index()
        row0 = 0
        for seg, nb in zip(op.outputs, seg_blocks):
            rows = row0 + np.arange(seg.c1 - seg.c0)
            w_phys[np.ix_(rows, cols)] = p.w_q[seg.c0 : seg.c1]
            b_phys[rows] = p.b_q[seg.c0 : seg.c1]
            shift_phys[rows] = p.shift[seg.c0 : seg.c1]
            rshift_phys[rows] = -p.res_shift[seg.c0 : seg.c1]
            row0 += nb * block
        # per-channel vectors: bias, the requantization shift parts, the residual alignment parts
        shift_vecs = shift_parts(shift_phys)
        rshift_vecs = shift_parts(rshift_phys) if op.residual is not None else []
        vecs = [b_phys] + [a for a, _ in shift_vecs] + [a for a, _ in rshift_vecs]
        n_vec = len(vecs)
        t, reason = conv_tiling(op, self.storage, self.graph.shapes, cfg, n_vec=n_vec)
        if t is None:
            from ...errors import BuildError

            raise BuildError(f"conv {op.name!r}: {reason}; expected a layer that prepare() accepted - report this as a bug")
        w_base = self._region(f"wgt:{op.name}", pack_weight(w_phys, block), cfg.wgt_elem_bytes)
        # the vectors, each padded to whole chunks: [n_vec, OB', block]
        ob_pad = -(-t.ob // t.obc) * t.obc
        vec = np.zeros((n_vec, ob_pad * block), np.int64)
        for j, v in enumerate(vecs):
            vec[j, :co_phys] = v
        b_base = self._region(f"vec:{op.name}", vec.astype("<i4").reshape(n_vec, ob_pad, block), cfg.acc_elem_bytes)
        # output block -> (DRAM element of block row 0, is-last-of-segment)
        out_elem = []
        for seg, nb in zip(op.outputs, seg_blocks):
            st = self.storage[seg.tensor]
            out_elem += [(st.elem + k * st.height * st.width, seg.tensor) for k in range(nb)]
        _, _, oh, ow = self.graph.shapes[op.outputs[0].tensor]
        s = op.strides[0]
        pt, pl, pb, pr = op.pads
        kk = t.kh * t.kw
        p_full = t.oht * ow
        vec_base = t.obc * p_full  # accumulator index of vector 0 (vector j at vec_base + j*obc)
        # with a residual: the input-buffer index of its tile (after the input rows) and the
        # weight-buffer index of the identity block (after the chunk's weights)
        res_inp, w_ident = (t.ibc * t.ht * t.wt, t.obc * t.ibc * kk) if op.residual is not None else (0, 0)
        # micro-op kernels: the ALU tile uop, one per vector, the identity GEMM's, then a GEMM
        # kernel over (oy, ib, i, j) per distinct reduction-chunk size (oy-major: a tile of fewer
        # rows uses a prefix of it)
        u_tile, u_ident = 0, 1 + n_vec
        red = [(b0, min(t.ibc, t.ib - b0)) for b0 in range(0, t.ib, t.ibc)]  # reduction chunks of input blocks
        dst = [np.zeros(2 + n_vec, np.int64)]
        src = [np.array([0] + [vec_base + j * t.obc for j in range(n_vec)] + [res_inp])]
        wgt, kernel_at = [np.array([0] * (1 + n_vec) + [w_ident])], {}
        pos = 2 + n_vec
        for ibn in sorted({n for _, n in red}, reverse=True):
            oy, ib, i, j = np.meshgrid(np.arange(t.oht), np.arange(ibn), np.arange(t.kh), np.arange(t.kw), indexing="ij")
            dst.append((oy * ow).reshape(-1))
            src.append((ib * t.ht * t.wt + (oy * s + i) * t.wt + j).reshape(-1))
            wgt.append(((ib * t.kh + i) * t.kw + j).reshape(-1))
            kernel_at[ibn] = pos
            pos += dst[-1].size
        uops = isa.encode_uop_arrays(np.concatenate(dst), np.concatenate(src), np.concatenate(wgt), cfg)
        u_base = self._region(f"uop:{op.name}", uops, cfg.uop_elem_bytes)
        res = self.storage[op.residual] if op.residual else None
        ident_base = self._identity() if res is not None else None

        def vector_shifts(st: dict, first: int, parts: list, obn: int, pcur: int) -> None:
            for j, (_, left) in enumerate(parts):
                st["compute"].append(_alu(isa.ALU_SHR, 1 + first + j, obn, pcur, dst_out=p_full, src_out=1, src_in=0, left=left))

        tiles = [(r, min(t.oht, oh - r)) for r in range(0, oh, t.oht)]
        chunks = [(c, min(t.obc, t.ob - c)) for c in range(0, t.ob, t.obc)]
        order = [(c, r) for c in chunks for r in tiles] if t.chunk_outer else [(c, r) for r in tiles for c in chunks]
        steps = _Steps()
        loaded_w = loaded_x = prev_chunk = None
        for n_tile, ((ob0, obn), (oy0, ohn)) in enumerate(order):
            pcur = ohn * ow
            for k, (ib0, ibn) in enumerate(red):
                st = steps.new()
                if n_tile == 0 and k == 0 and res is not None:
                    st["load"].append(isa.MemInsn(memory_type=isa.MEM_WGT, sram_base=w_ident, dram_base=ident_base,
                                                  y_size=1, x_size=1, x_stride=1))
                if loaded_w != (ob0, obn, ib0, ibn):
                    if ibn == t.ib:  # all input blocks: the chunk's weights are contiguous
                        st["load"].append(isa.MemInsn(memory_type=isa.MEM_WGT, sram_base=0, dram_base=w_base + ob0 * t.ib * kk,
                                                      y_size=1, x_size=obn * t.ib * kk, x_stride=obn * t.ib * kk))
                    else:  # one row of ibn*kk blocks per output block, IB*kk apart
                        st["load"].append(isa.MemInsn(memory_type=isa.MEM_WGT, sram_base=0, dram_base=w_base + (ob0 * t.ib + ib0) * kk,
                                                      y_size=obn, x_size=ibn * kk, x_stride=t.ib * kk))
                    loaded_w = (ob0, obn, ib0, ibn)
                if loaded_x != (oy0, ohn, ib0, ibn):
                    st["load"] += self._input_loads(inp, t, oy0, ohn, s, pt, pl, pr, ib0, ibn)
                    loaded_x = (oy0, ohn, ib0, ibn)
                if k == 0 and res is not None:  # the residual tile, int8, beside the input rows
                    st["load"] += _blocks_dma(isa.OP_LOAD, isa.MEM_INP, [res.elem + (ob0 + c) * oh * ow + oy0 * ow for c in range(obn)],
                                              res_inp, p_full, pcur, oh * ow)
                if n_tile == 0 and k == 0:
                    st["compute"].append(isa.MemInsn(memory_type=isa.MEM_UOP, sram_base=0, dram_base=u_base, y_size=1,
                                                     x_size=len(uops), x_stride=len(uops)))
                if k == 0 and (ob0, obn) != prev_chunk:
                    st["compute"].append(isa.MemInsn(memory_type=isa.MEM_ACC, sram_base=vec_base, dram_base=b_base + ob0,
                                                     y_size=n_vec, x_size=t.obc, x_stride=ob_pad))
                    prev_chunk = (ob0, obn)
                if k == 0:
                    st["compute"].append(isa.GemmInsn(reset_reg=True, uop_bgn=u_tile, uop_end=u_tile + 1, iter_out=obn,
                                                      iter_in=pcur, dst_factor_out=p_full, dst_factor_in=1))
                if k == 0 and res is not None:  # the accumulators start from the residual, aligned to F
                    st["compute"].append(isa.GemmInsn(uop_bgn=u_ident, uop_end=u_ident + 1, iter_out=obn, iter_in=pcur,
                                                      dst_factor_out=p_full, dst_factor_in=1, src_factor_out=p_full, src_factor_in=1))
                    vector_shifts(st, 1 + len(shift_vecs), rshift_vecs, obn, pcur)
                u0 = kernel_at[ibn]
                st["compute"].append(isa.GemmInsn(uop_bgn=u0, uop_end=u0 + ohn * ibn * kk, iter_out=obn, iter_in=ow,
                                                  dst_factor_out=p_full, dst_factor_in=1, src_factor_out=0, src_factor_in=s,
                                                  wgt_factor_out=ibn * kk, wgt_factor_in=0))
                st["release"] = len(st["compute"]) - 1
                if k < len(red) - 1:
                    continue
                st["compute"].append(_alu(isa.ALU_ADD, 1, obn, pcur, dst_out=p_full, src_out=1, src_in=0))
                vector_shifts(st, 1, shift_vecs, obn, pcur)
                _epilogue_tail(st, u_tile, obn, pcur, p_full, 0, p.lo, p.hi)
                st["store"] += _blocks_dma(isa.OP_STORE, isa.MEM_OUT, [out_elem[ob0 + c][0] + oy0 * ow for c in range(obn)],
                                           0, p_full, pcur, oh * ow)
        return Program(op.name, steps.finish(), "conv", {**t.to_dict(), "vectors": n_vec})

    def _input_loads(self, inp: Storage, t: ConvTiling, oy0: int, ohn: int, s: int, pt: int, pl: int, pr: int,
                     ib0: int, ibn: int) -> list:
        h, w = inp.height, inp.width
        h0 = oy0 * s - pt
        hn = (ohn - 1) * s + t.kh
        v0, v1 = max(h0, 0), min(h0 + hn, h)
        y_pad_0, y_pad_1 = v0 - h0, h0 + hn - v1
        if y_pad_0 == 0 and y_pad_1 == 0 and hn == h == t.ht:
            # whole input blocks, back to back in DRAM and (with x padding) in SRAM: one DMA
            return [isa.MemInsn(memory_type=isa.MEM_INP, sram_base=0, dram_base=inp.elem + ib0 * h * w, y_size=ibn * h, x_size=w,
                                x_stride=w, x_pad_0=pl, x_pad_1=pr)]
        return [
            isa.MemInsn(memory_type=isa.MEM_INP, sram_base=k * t.ht * t.wt, dram_base=inp.elem + ((ib0 + k) * h + v0) * w,
                        y_size=v1 - v0, x_size=w, x_stride=w, y_pad_0=y_pad_0, y_pad_1=y_pad_1, x_pad_0=pl, x_pad_1=pr)
            for k in range(ibn)
        ]

    # ------------------------------------------------------------------ element-wise and copies
    def _eltwise(self, op: EltwiseOp) -> Program:
        """``clamp((sum_k x_k << a_k) + r) >> s``: the inputs enter the accumulators through identity
        GEMMs in decreasing order of their alignment ``a_k``, with the left shifts between them
        (Horner), then the requantization (:func:`_requantize`) and the clamp."""
        cfg = self.cfg
        p = int_eltwise(op, self.q)
        ins = [self.storage[n] for n in op.inputs]
        out = self.storage[op.output]
        total = out.layout.blocks * out.height * out.width
        per = min(cfg.acc_depth, cfg.inp_depth // len(ins), (1 << isa.LOOP_ITER_WIDTH) - 1)
        order = sorted(range(len(ins)), key=lambda k: -p.in_shifts[k])
        aligns = [p.in_shifts[k] for k in order] + [0]
        # uops: 0 = the accumulator chunk (reset, ALU), 1 + k = identity GEMM of input k (inp region k)
        n = len(ins)
        uops = isa.encode_uop_arrays(np.zeros(1 + n, np.int64), np.array([0] + [k * per for k in range(n)]),
                                     np.zeros(1 + n, np.int64), cfg)
        u_base = self._region(f"uop:{op.name}", uops, cfg.uop_elem_bytes)
        ident = self._identity()
        steps = _Steps()
        for n_step, e0 in enumerate(range(0, total, per)):
            m = min(per, total - e0)
            st = steps.new()
            if n_step == 0:
                st["load"].append(isa.MemInsn(memory_type=isa.MEM_WGT, sram_base=0, dram_base=ident, y_size=1, x_size=1, x_stride=1))
                st["compute"].append(isa.MemInsn(memory_type=isa.MEM_UOP, sram_base=0, dram_base=u_base, y_size=1,
                                                 x_size=1 + n, x_stride=1 + n))
            for k, src in enumerate(ins):
                st["load"].append(isa.MemInsn(memory_type=isa.MEM_INP, sram_base=k * per, dram_base=src.elem + e0,
                                              y_size=1, x_size=m, x_stride=m))
            st["compute"].append(isa.GemmInsn(reset_reg=True, uop_bgn=0, uop_end=1, iter_in=m, dst_factor_in=1))
            for j, k in enumerate(order):
                st["compute"].append(isa.GemmInsn(uop_bgn=1 + k, uop_end=2 + k, iter_in=m, dst_factor_in=1, src_factor_in=1))
                st["release"] = len(st["compute"]) - 1
                for a in imm_shift_parts(-(aligns[j] - aligns[j + 1])):
                    st["compute"].append(_alu(isa.ALU_SHR, 0, 1, m, imm=a))
            _requantize(st, 0, 1, m, 0, p.shift)
            _epilogue_tail(st, 0, 1, m, 0, 0, p.lo, p.hi)
            st["store"].append(isa.MemInsn(opcode=isa.OP_STORE, memory_type=isa.MEM_OUT, sram_base=0, dram_base=out.elem + e0,
                                           y_size=1, x_size=m, x_stride=m))
        return Program(op.name, steps.finish(), "eltwise", {"elements": total, "per_step": per})

    def _copy(self, op: ConcatOp) -> Program:
        """A concat whose inputs are not views of its block: each input chunk through an identity
        GEMM (the hardware stores only what GEMM/ALU wrote), then STORE at the concat offset."""
        cfg = self.cfg
        out = self.storage[op.output]
        per = min(cfg.acc_depth, cfg.inp_depth, (1 << isa.LOOP_ITER_WIDTH) - 1)
        uops = isa.encode_uop_arrays(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64), cfg)
        u_base = self._region(f"uop:{op.name}", uops, cfg.uop_elem_bytes)
        ident = self._identity()
        steps = _Steps()
        offset = 0
        for name in op.inputs:
            src = self.storage[name]
            total = src.layout.blocks * src.height * src.width
            dst0 = out.elem + offset * out.height * out.width
            for e0 in range(0, total, per):
                n = min(per, total - e0)
                st = steps.new()
                if not steps.steps[:-1]:
                    st["load"].append(isa.MemInsn(memory_type=isa.MEM_WGT, dram_base=ident, y_size=1, x_size=1, x_stride=1))
                    st["compute"].append(isa.MemInsn(memory_type=isa.MEM_UOP, dram_base=u_base, y_size=1, x_size=1, x_stride=1))
                st["load"].append(isa.MemInsn(memory_type=isa.MEM_INP, dram_base=src.elem + e0, y_size=1, x_size=n, x_stride=n))
                st["compute"].append(isa.GemmInsn(reset_reg=True, uop_bgn=0, uop_end=1, iter_in=n, dst_factor_in=1))
                st["compute"].append(isa.GemmInsn(uop_bgn=0, uop_end=1, iter_in=n, dst_factor_in=1, src_factor_in=1))
                st["store"].append(isa.MemInsn(opcode=isa.OP_STORE, memory_type=isa.MEM_OUT, sram_base=0, dram_base=dst0 + e0,
                                               y_size=1, x_size=n, x_stride=n))
            offset += src.layout.blocks
        return Program(op.name, steps.finish(), "copy", {})


def _requantize(step: dict, uop: int, iter_out: int, iter_in: int, dst_out: int, shift: int) -> None:
    """``acc = (acc + 2**(shift-1)) >> shift`` (round half up; a left shift for ``shift < 0``) in
    SHR instructions of at most 15, the rounding added before the last 15:
    ``(a + 2**(s-1)) >> s == ((a >> (s-t)) + 2**(t-1)) >> t`` for ``0 < t <= s`` (the dropped low
    bits cannot carry into bit ``s``), so the rounding constant fits the 16-bit immediate."""
    if shift <= 0:
        for a in imm_shift_parts(shift):
            step["compute"].append(_alu(isa.ALU_SHR, uop, iter_out, iter_in, dst_out=dst_out, imm=a))
        return
    last = min(shift, SHR_RIGHT_MAX)
    for a in imm_shift_parts(shift - last):
        step["compute"].append(_alu(isa.ALU_SHR, uop, iter_out, iter_in, dst_out=dst_out, imm=a))
    step["compute"].append(_alu(isa.ALU_ADD, uop, iter_out, iter_in, dst_out=dst_out, imm=1 << (last - 1)))
    step["compute"].append(_alu(isa.ALU_SHR, uop, iter_out, iter_in, dst_out=dst_out, imm=last))


@dataclass
class CompiledVTA:
    """Everything an inference needs: graph, scales, storage, programs, DRAM image."""

    graph: VTAGraph
    q: Quantization
    storage: dict[str, Storage]
    cfg: VTAConfig
    image: np.ndarray  # uint8 DRAM image
    regions: dict[str, tuple[int, int]]
    programs: dict[str, Program]
    streams: dict[str, np.ndarray] = field(default_factory=dict)  # encoded instructions per program

    def instruction_counts(self) -> dict[str, int]:
        return {name: len(p.insns) for name, p in self.programs.items()}


def compile_graph(graph: VTAGraph, q: Quantization, cfg: VTAConfig = DEFAULT) -> CompiledVTA:
    """Generate the programs and the DRAM image of a prepared, quantized graph."""
    storage = prepare(graph, cfg)
    comp = Compiler(graph, q, storage, cfg).compile()
    for name, st in storage.items():
        st.base = storage[st.root].base
    streams = {name: p.encoded(cfg) for name, p in comp.programs.items()}
    image = comp.dram.data[: comp.dram.top].copy()
    return CompiledVTA(graph, q, storage, cfg, image, comp.regions, comp.programs, streams)
