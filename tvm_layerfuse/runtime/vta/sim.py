"""A VTA simulator: executes an instruction stream bit-exactly, with VTA's counters.

Two modes. ``hardware`` (the default) executes what both hardware designs execute - the
FPGA design (``hardware/xilinx/src/vta.cc``, what a PYNQ/Ultra96 bitstream is built from)
and the Chisel design (``hardware/chisel``) - and refuses, in one line naming the program
and the instruction, every form on which they differ from the functional simulator:

* a ``LOAD acc8`` (memory type 5; only ``sim_driver.cc`` has it);
* a ``STORE`` of accumulators that no GEMM or ALU wrote since they were loaded or reset:
  the hardware stores from a separate output buffer (``out_mem``) that only GEMM and ALU
  write, as they finish each element (modelled here);
* an ALU shift amount outside the FPGA design's signed 5-bit range -16..15;
* a vector-mode SHR whose lanes' signs disagree with the immediate's sign bit (the Chisel
  design chooses left or right from that bit for all lanes);
* ``MUL`` (neither design has it);
* a weight LOAD with padding (the FPGA design's weight DMA has none), and a micro-op LOAD
  of more than one row or with padding (the FPGA design copies ``x_size`` words).

``functional`` is upstream's functional simulator (``sim_driver.cc``), for comparison.
See docs/vta.md for the upstream file and line of each rule.

What each instruction does (both modes, but for the above):

* ``LOAD`` copies ``y_size`` rows of ``x_size`` elements, ``x_stride`` elements apart in
  DRAM, into consecutive SRAM elements, with ``y_pad_*`` zero rows and ``x_pad_*`` zero
  elements around them. ``acc8`` loads int8 values sign-extended into the accumulators.
* ``GEMM`` runs ``for o < iter_out, i < iter_in, u in uops``::

      acc[dst_u + o*dst_out + i*dst_in] += inp[src_u + o*src_out + i*src_in] . wgt[wgt_u + ...]^T

  (int8 x int8 products summed in int32, wrapping) or zeroes ``acc[dst]`` with ``reset_reg``.
* ``ALU`` applies MIN/MAX/ADD/SHR/MUL (int32) of ``acc[dst]`` and ``imm`` or ``acc[src]``;
  SHR by a negative amount shifts left.
* ``STORE`` writes the low 8 bits of the accumulators: in ``functional`` mode narrowed at
  store time, in ``hardware`` mode from the output buffer GEMM/ALU wrote.

The three modules (load, compute, store; see :func:`isa.module_of`) run concurrently in
hardware and synchronise only through four token queues (load->compute, compute->load,
compute->store, store->compute). The simulator runs each module in order and lets it
block on a ``pop`` whose token has not been pushed. Two kinds of misuse are errors:

* **deadlock**: no module can make progress while instructions remain;
* **hazard**: two modules touch the same SRAM element and no chain of tokens orders the
  accesses (a read-after-write or write-after-read across modules). The check uses
  vector clocks carried by the tokens, so it does not depend on the order in which the
  simulator happens to interleave the modules; a program it accepts computes the same
  result under every interleaving the hardware may choose.

Tokens left in a queue at the end, and a ``FINISH`` that does not wait for the last
``STORE``, are errors too. Execution is vectorised with numpy per instruction.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from ...errors import LayerfuseError
from . import isa
from .config import DEFAULT, VTAConfig

log = logging.getLogger(__name__)

MODULES = ("load", "compute", "store")
_M = {m: k for k, m in enumerate(MODULES)}
_GATHER_CHUNK = 8192  # GEMM steps per vectorised chunk (bounds the gathered weight blocks)


class VTAProgramError(LayerfuseError):
    """An instruction stream VTA cannot run correctly."""


class DeadlockError(VTAProgramError):
    """A module waits for a dependency token that is never pushed."""


class HazardError(VTAProgramError):
    """Two modules access the same SRAM element without a token ordering them."""


class HardwareError(VTAProgramError):
    """An instruction the VTA hardware designs do not execute as the functional simulator does."""


MODES = ("hardware", "functional")
SHIFT_MIN, SHIFT_MAX = -16, 15
"""The FPGA design's ALU shift amount: the low ``LOG_ACC_WIDTH`` = 5 bits, signed (``aluop_shr_arg_T``)."""


@dataclass
class Counters:
    """VTA's profiler counters (``vta.simulator.profiler_status``) plus instruction counts.

    Defined as upstream's ``sim_driver.cc`` defines them: a LOAD counts ``x_size * y_size``
    elements of its buffer kind (``acc8`` loads, functional mode only, count accumulator
    elements), a STORE ``x_size * y_size`` output elements; ``gemm_counter``/``alu_counter``
    count micro-op executions (a GEMM reset counts none)."""

    inp_load_nbytes: int = 0
    wgt_load_nbytes: int = 0
    acc_load_nbytes: int = 0
    uop_load_nbytes: int = 0
    out_store_nbytes: int = 0
    gemm_counter: int = 0
    alu_counter: int = 0
    insn_load: int = 0
    insn_store: int = 0
    insn_gemm: int = 0
    insn_alu: int = 0
    insn_finish: int = 0

    @property
    def load_nbytes(self) -> int:
        return self.inp_load_nbytes + self.wgt_load_nbytes + self.acc_load_nbytes + self.uop_load_nbytes

    @property
    def dram_nbytes(self) -> int:
        return self.load_nbytes + self.out_store_nbytes

    @property
    def insn_count(self) -> int:
        return self.insn_load + self.insn_store + self.insn_gemm + self.insn_alu + self.insn_finish

    def add(self, other: "Counters") -> "Counters":
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)
        return self

    def to_dict(self) -> dict[str, int]:
        out = asdict(self)
        out.update(load_nbytes=self.load_nbytes, dram_nbytes=self.dram_nbytes, insn_count=self.insn_count)
        return out


class DRAM:
    """Byte-addressed device memory with aligned bump allocation."""

    def __init__(self, nbytes: int = 0) -> None:
        self.data = np.zeros(max(int(nbytes), 0), dtype=np.uint8)
        self.top = 0

    def alloc(self, nbytes: int, *, align: int = 256) -> int:
        """Byte address of a new zeroed region of ``nbytes``."""
        addr = -(-self.top // align) * align
        end = addr + int(nbytes)
        if end > self.data.size:
            grown = np.zeros(max(end, 2 * self.data.size), dtype=np.uint8)
            grown[: self.data.size] = self.data
            self.data = grown
        self.top = end
        return addr

    def write(self, addr: int, array: np.ndarray) -> None:
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        self.data[addr : addr + raw.size] = raw

    def read(self, addr: int, nbytes: int) -> np.ndarray:
        return self.data[addr : addr + nbytes].copy()

    def elements(self, elem_bytes: int) -> np.ndarray:
        """The whole memory as ``[n, elem_bytes]`` (a view; element ``k`` at byte ``k*elem_bytes``)."""
        n = self.data.size // elem_bytes
        return self.data[: n * elem_bytes].reshape(n, elem_bytes)


@dataclass
class _Queues:
    tokens: dict = field(default_factory=lambda: {q: deque() for q in ("l2g", "g2l", "g2s", "s2g")})


# (module, flag) -> token queue popped / pushed
_POP = {("load", "pop_next"): "g2l", ("compute", "pop_prev"): "l2g", ("compute", "pop_next"): "s2g", ("store", "pop_prev"): "g2s"}
_PUSH = {("load", "push_next"): "l2g", ("compute", "push_prev"): "g2l", ("compute", "push_next"): "g2s", ("store", "push_prev"): "s2g"}
_QUEUE_NAMES = {"l2g": "load->compute", "g2l": "compute->load", "g2s": "compute->store", "s2g": "store->compute"}


class Simulator:
    """One VTA device: SRAM buffers, DRAM, counters. :meth:`run` executes a program."""

    def __init__(self, cfg: VTAConfig = DEFAULT, dram: Optional[DRAM] = None, *, mode: str = "hardware") -> None:
        if mode not in MODES:
            raise ValueError(f"simulator mode {mode!r} is unknown; expected one of {', '.join(MODES)}")
        self.cfg = cfg
        self.mode = mode
        self.hardware = mode == "hardware"
        self.dram = dram if dram is not None else DRAM()
        b = cfg.block
        self._inp_b = np.zeros((cfg.inp_depth, cfg.inp_elem_bytes), np.uint8)
        self._wgt_b = np.zeros((cfg.wgt_depth, cfg.wgt_elem_bytes), np.uint8)
        self._acc_b = np.zeros((cfg.acc_depth, cfg.acc_elem_bytes), np.uint8)
        self._uop_b = np.zeros((cfg.uop_depth, 4), np.uint8)
        self.inp = self._inp_b.view(np.int8)  # [depth, block_in]
        self.wgt = self._wgt_b.view(np.int8).reshape(cfg.wgt_depth, b, b)  # [depth, block_out, block_in]
        self.acc = self._acc_b.view("<i4")  # [depth, block_out]
        self.uop_words = self._uop_b.view("<u4").reshape(-1)
        self.out = np.zeros((cfg.acc_depth, b), np.int8)  # the FPGA design's out_mem (hardware mode)
        self._out_valid = np.zeros(cfg.acc_depth, bool)  # written by a GEMM/ALU since the last LOAD acc / reset
        self.program = "?"
        self.counters = Counters()
        self._uop_cache: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None

    # ------------------------------------------------------------------ program
    def run(self, program: Union[np.ndarray, bytes, Sequence[isa.Insn]], *, name: str = "?") -> Counters:
        """Execute one program (instructions or their bytes); returns this run's counters.
        ``name`` names the program in error messages."""
        self.program = name
        insns = list(program) if not isinstance(program, (bytes, np.ndarray)) else isa.decode_stream(program, self.cfg)
        before = Counters().add(self.counters)
        streams: dict[str, list[tuple[int, isa.Insn]]] = {m: [] for m in MODULES}
        for k, insn in enumerate(insns):
            streams[isa.module_of(insn)].append((k, insn))
            self._check_flags(k, insn)
        finishes = [k for k, i in enumerate(insns) if isinstance(i, isa.FinishInsn)]
        if finishes != [len(insns) - 1]:
            raise VTAProgramError(
                f"VTA program of {len(insns)} instructions has FINISH at {finishes or 'no position'}; "
                "expected exactly one FINISH, as the last instruction"
            )
        self._prepare_hazards()
        pos = {m: 0 for m in MODULES}
        clock = {m: 0 for m in MODULES}
        vc = {m: [0, 0, 0] for m in MODULES}
        queues = _Queues().tokens
        progress = True
        while progress:
            progress = False
            for m in MODULES:
                while pos[m] < len(streams[m]):
                    k, insn = streams[m][pos[m]]
                    pops = [q for (mm, flag), q in _POP.items() if mm == m and getattr(insn, flag)]
                    if any(not queues[q] for q in pops):
                        break
                    for q in pops:
                        token = queues[q].popleft()
                        vc[m] = [max(a, b) for a, b in zip(vc[m], token)]
                    clock[m] += 1
                    vc[m][_M[m]] = clock[m]
                    self._execute(k, insn, m, vc[m], total_stores=len(streams["store"]))
                    for (mm, flag), q in _PUSH.items():
                        if mm == m and getattr(insn, flag):
                            queues[q].append(list(vc[m]))
                    pos[m] += 1
                    progress = True
        stuck = [m for m in MODULES if pos[m] < len(streams[m])]
        if stuck:
            parts = []
            for m in stuck:
                k, insn = streams[m][pos[m]]
                waits = [_QUEUE_NAMES[q] for (mm, flag), q in _POP.items() if mm == m and getattr(insn, flag) and not queues[q]]
                parts.append(f"{m} module at instruction {k} ({isa.describe(insn)}) waits for a {'/'.join(waits)} token")
            raise DeadlockError("VTA program deadlocks: " + "; ".join(parts) + " that is never pushed")
        left = {q: len(v) for q, v in queues.items() if v}
        if left:
            desc = ", ".join(f"{n} in {_QUEUE_NAMES[q]}" for q, n in left.items())
            raise DeadlockError(
                f"VTA program ends with unconsumed dependency tokens ({desc}); expected every pushed token to be "
                "popped - the next program would start out of step"
            )
        run = Counters()
        for k, v in asdict(self.counters).items():
            setattr(run, k, v - getattr(before, k))
        return run

    def _check_flags(self, k: int, insn: isa.Insn) -> None:
        m = isa.module_of(insn)
        for flag in ("pop_prev", "pop_next", "push_prev", "push_next"):
            if getattr(insn, flag) and (m, flag) not in _POP and (m, flag) not in _PUSH:
                raise VTAProgramError(
                    f"instruction {k} ({isa.describe(insn)}) runs on the {m} module, which has no {flag} queue; "
                    "expected only the flags of that module's neighbours"
                )

    # ------------------------------------------------------------------ hazards
    def _prepare_hazards(self) -> None:
        cfg = self.cfg
        # last writer clock (of the producing module) and last reader clock (of the consumer)
        self._inp_w = np.zeros(cfg.inp_depth, np.int64)
        self._inp_r = np.zeros(cfg.inp_depth, np.int64)
        self._wgt_w = np.zeros(cfg.wgt_depth, np.int64)
        self._wgt_r = np.zeros(cfg.wgt_depth, np.int64)
        self._acc_w = np.zeros(cfg.acc_depth, np.int64)
        self._acc_r = np.zeros(cfg.acc_depth, np.int64)

    @staticmethod
    def _hazard(k: int, insn: isa.Insn, what: str) -> HazardError:
        return HazardError(
            f"VTA program hazard at instruction {k} ({isa.describe(insn)}): {what}; expected a dependency token "
            "between the two modules - set the push/pop flags"
        )

    def _refuse(self, k: int, insn: isa.Insn, what: str, fix: str) -> HardwareError:
        return HardwareError(
            f"VTA program {self.program!r}, instruction {k} ({isa.describe(insn)}): {what}; {fix} "
            "(or run the simulator with mode='functional' to compare with sim_driver.cc)"
        )

    def _guard(self, k, insn, stamps: np.ndarray, idx: np.ndarray, known: int, what: str) -> None:
        if idx.size and int(stamps[idx].max()) > known:
            raise self._hazard(k, insn, what)

    # ------------------------------------------------------------------ execution
    def _execute(self, k: int, insn: isa.Insn, module: str, vc: list[int], *, total_stores: int) -> None:
        c = self.counters
        now = vc[_M[module]]
        if isinstance(insn, isa.MemInsn) and insn.opcode == isa.OP_LOAD:
            c.insn_load += 1
            self._load(k, insn, vc, now)
        elif isinstance(insn, isa.MemInsn):
            c.insn_store += 1
            self._store(k, insn, vc, now)
        elif isinstance(insn, isa.GemmInsn):
            c.insn_gemm += 1
            self._gemm(k, insn, vc, now)
        elif isinstance(insn, isa.AluInsn):
            c.insn_alu += 1
            self._alu(k, insn, vc, now)
        else:
            c.insn_finish += 1
            if vc[_M["store"]] < total_stores:
                raise self._hazard(k, insn, f"FINISH may complete before STORE {total_stores} of the store module")

    def _range(self, k, insn, base: int, count: int, depth: int, kind: str) -> np.ndarray:
        if base + count > depth:
            raise VTAProgramError(
                f"instruction {k} ({isa.describe(insn)}) reaches {kind} element {base + count - 1}; "
                f"the {kind} buffer holds {depth}"
            )
        return np.arange(base, base + count)

    def _load(self, k: int, insn: isa.MemInsn, vc: list[int], now: int) -> None:
        cfg = self.cfg
        if insn.x_size == 0:
            return
        mt = insn.memory_type
        kinds = {isa.MEM_INP: "inp", isa.MEM_WGT: "wgt", isa.MEM_ACC: "acc", isa.MEM_UOP: "uop", isa.MEM_ACC_8BIT: "acc"}
        if mt not in kinds:
            raise VTAProgramError(
                f"instruction {k} ({isa.describe(insn)}): LOAD into memory type {mt}; expected uop, wgt, inp, acc or acc8"
            )
        kind = kinds[mt]
        if self.hardware:
            pads = (insn.y_pad_0, insn.y_pad_1, insn.x_pad_0, insn.x_pad_1)
            if mt == isa.MEM_ACC_8BIT:
                raise self._refuse(k, insn, "LOAD acc8 exists only in the functional simulator (the FPGA design ignores it, "
                                   "the Chisel design's decoder has no pattern for it)",
                                   "expected LOAD inp and a GEMM with an identity weight block to bring int8 data into the accumulators")
            if mt == isa.MEM_WGT and any(pads):
                raise self._refuse(k, insn, "a weight LOAD with padding (the FPGA design's weight DMA has none)",
                                   "expected all pads 0 - store zero weight blocks in DRAM instead")
            if mt == isa.MEM_UOP and (insn.y_size != 1 or any(pads)):
                raise self._refuse(k, insn, "a micro-op LOAD of several rows or with padding (the FPGA design copies x_size words)",
                                   "expected y_size 1 and no padding")
        src_eb = cfg.inp_elem_bytes if mt == isa.MEM_ACC_8BIT else cfg.elem_bytes(kind)
        xt = insn.x_size + insn.x_pad_0 + insn.x_pad_1
        yt = insn.y_size + insn.y_pad_0 + insn.y_pad_1
        depth = getattr(cfg, f"{kind}_depth")
        idx = self._range(k, insn, insn.sram_base, xt * yt, depth, kind)
        elems = self.dram.elements(src_eb)
        rows = insn.dram_base + np.arange(insn.y_size)[:, None] * insn.x_stride + np.arange(insn.x_size)[None, :]
        if rows.size and rows.max() >= elems.shape[0]:
            raise VTAProgramError(f"instruction {k} ({isa.describe(insn)}) reads past the end of DRAM")
        data = elems[rows]  # [y_size, x_size, src_eb]
        nbytes = insn.x_size * insn.y_size * cfg.elem_bytes(kind)  # sim_driver.cc: elements of the buffer kind
        c = self.counters
        if kind == "inp":
            self._guard(k, insn, self._inp_r, idx, vc[_M["compute"]], "LOAD overwrites input elements a GEMM may still read")
            target, c.inp_load_nbytes = self._inp_b, c.inp_load_nbytes + nbytes
            self._inp_w[idx] = now
        elif kind == "wgt":
            self._guard(k, insn, self._wgt_r, idx, vc[_M["compute"]], "LOAD overwrites weight elements a GEMM may still read")
            target, c.wgt_load_nbytes = self._wgt_b, c.wgt_load_nbytes + nbytes
            self._wgt_w[idx] = now
        elif kind == "uop":
            target, c.uop_load_nbytes = self._uop_b, c.uop_load_nbytes + nbytes
            self._uop_cache = None
        else:
            self._guard(k, insn, self._acc_r, idx, vc[_M["store"]], "LOAD overwrites accumulators a STORE may still read")
            target, c.acc_load_nbytes = self._acc_b, c.acc_load_nbytes + nbytes
            self._acc_w[idx] = now
            self._out_valid[idx] = False
            if mt == isa.MEM_ACC_8BIT:  # int8 sign-extended to int32
                data = data.view(np.int8).astype("<i4").view(np.uint8).reshape(insn.y_size, insn.x_size, -1)
        block = np.zeros((yt, xt, target.shape[1]), np.uint8)
        block[insn.y_pad_0 : insn.y_pad_0 + insn.y_size, insn.x_pad_0 : insn.x_pad_0 + insn.x_size] = data
        target[insn.sram_base : insn.sram_base + xt * yt] = block.reshape(xt * yt, -1)

    def _store(self, k: int, insn: isa.MemInsn, vc: list[int], now: int) -> None:
        cfg = self.cfg
        if insn.x_size == 0:
            return
        if insn.memory_type != isa.MEM_OUT:
            raise VTAProgramError(f"instruction {k} ({isa.describe(insn)}): STORE from memory type {insn.memory_type}; expected out (4)")
        if insn.x_pad_0 or insn.x_pad_1 or insn.y_pad_0 or insn.y_pad_1:
            raise VTAProgramError(f"instruction {k} ({isa.describe(insn)}): a STORE has no padding; expected all pads 0")
        idx = self._range(k, insn, insn.sram_base, insn.x_size * insn.y_size, cfg.acc_depth, "acc")
        self._guard(k, insn, self._acc_w, idx, vc[_M["compute"]], "STORE reads accumulators a GEMM/ALU may still write")
        self._acc_r[idx] = now
        if self.hardware:
            if not self._out_valid[idx].all():
                bad = int(idx[~self._out_valid[idx]][0])
                raise self._refuse(k, insn, f"STORE of accumulator {bad}, which no GEMM or ALU wrote since it was loaded or "
                                   "reset (the hardware stores from the output buffer, which only GEMM and ALU write)",
                                   "expected a GEMM or ALU instruction on every stored element after its LOAD")
            values = self.out[idx]
        else:
            values = self.acc[idx].astype(np.int8)  # truncation to the low 8 bits (two's complement wrap)
        elems = self.dram.elements(cfg.out_elem_bytes)
        rows = insn.dram_base + np.arange(insn.y_size)[:, None] * insn.x_stride + np.arange(insn.x_size)[None, :]
        if rows.max() >= elems.shape[0]:
            raise VTAProgramError(f"instruction {k} ({isa.describe(insn)}) writes past the end of DRAM")
        elems[rows.reshape(-1)] = values.view(np.uint8)
        self.counters.out_store_nbytes += insn.x_size * insn.y_size * cfg.out_elem_bytes

    def _uops(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._uop_cache is None:
            self._uop_cache = isa.decode_uops(self.uop_words, self.cfg)
        return self._uop_cache

    def _indices(self, k, insn, factors: Sequence[tuple[np.ndarray, int, int, int, str]]) -> list[np.ndarray]:
        """Flattened ``base_u + o*f_out + i*f_in`` for each (base, f_out, f_in, depth, kind), o-i-u order."""
        o = np.arange(insn.iter_out)[:, None, None]
        i = np.arange(insn.iter_in)[None, :, None]
        out = []
        for base, f_out, f_in, depth, kind in factors:
            idx = (base[None, None, :] + o * f_out + i * f_in).reshape(-1)
            if idx.size and idx.max() >= depth:
                raise VTAProgramError(
                    f"instruction {k} ({isa.describe(insn)}) addresses {kind} element {int(idx.max())}; the {kind} buffer holds {depth}"
                )
            out.append(idx)
        return out

    def _gemm(self, k: int, insn: isa.GemmInsn, vc: list[int], now: int) -> None:
        cfg = self.cfg
        if insn.uop_end < insn.uop_bgn or insn.uop_end > cfg.uop_depth:
            raise VTAProgramError(f"instruction {k} ({isa.describe(insn)}): micro-op range outside the uop buffer")
        dst_u, src_u, wgt_u = (a[insn.uop_bgn : insn.uop_end] for a in self._uops())
        steps = insn.iter_out * insn.iter_in * (insn.uop_end - insn.uop_bgn)
        if insn.reset_reg:
            (dst,) = self._indices(k, insn, [(dst_u, insn.dst_factor_out, insn.dst_factor_in, cfg.acc_depth, "acc")])
            self._guard(k, insn, self._acc_r, dst, vc[_M["store"]], "GEMM reset overwrites accumulators a STORE may still read")
            self.acc[dst] = 0
            self._acc_w[dst] = now
            self._out_valid[dst] = False  # the FPGA design writes old + dot product to out_mem
            return
        self.counters.gemm_counter += steps
        dst, src, wgt = self._indices(
            k,
            insn,
            [
                (dst_u, insn.dst_factor_out, insn.dst_factor_in, cfg.acc_depth, "acc"),
                (src_u, insn.src_factor_out, insn.src_factor_in, cfg.inp_depth, "inp"),
                (wgt_u, insn.wgt_factor_out, insn.wgt_factor_in, cfg.wgt_depth, "wgt"),
            ],
        )
        self._guard(k, insn, self._inp_w, src, vc[_M["load"]], "GEMM reads input elements a LOAD may still write")
        self._guard(k, insn, self._wgt_w, wgt, vc[_M["load"]], "GEMM reads weight elements a LOAD may still write")
        self._guard(k, insn, self._acc_r, dst, vc[_M["store"]], "GEMM writes accumulators a STORE may still read")
        self._inp_r[src] = now
        self._wgt_r[wgt] = now
        self._acc_w[dst] = now
        # int8 dot products in float32 are exact (|dot| <= block * 128 * 128 < 2**24), and their
        # float64 sums per accumulator too (< 2**53); adding them mod 2**32 equals the hardware's
        # step-by-step wrapping int32 additions (addition mod 2**32 is associative)
        block = cfg.block
        total = np.zeros(cfg.acc_depth * block, np.float64)
        lanes = np.arange(block)
        for s in range(0, dst.size, _GATHER_CHUNK):
            d, x, w = dst[s : s + _GATHER_CHUNK], src[s : s + _GATHER_CHUNK], wgt[s : s + _GATHER_CHUNK]
            a = self.inp[x].astype(np.float32)  # [n, block_in]
            b = self.wgt[w].astype(np.float32)  # [n, block_out, block_in]
            prod = np.matmul(b, a[:, :, None])[:, :, 0]  # [n, block_out]
            total += np.bincount((d[:, None] * block + lanes).reshape(-1), weights=prod.reshape(-1), minlength=total.size)
        touched = np.unique(dst)
        summed = total.reshape(cfg.acc_depth, block)[touched].astype(np.int64)
        self.acc[touched] = (self.acc[touched].astype(np.int64) + summed).astype(np.int32)  # wraps like the hardware
        self._wrote(touched)

    def _alu(self, k: int, insn: isa.AluInsn, vc: list[int], now: int) -> None:
        cfg = self.cfg
        if insn.uop_end < insn.uop_bgn or insn.uop_end > cfg.uop_depth:
            raise VTAProgramError(f"instruction {k} ({isa.describe(insn)}): micro-op range outside the uop buffer")
        if insn.alu_opcode not in isa.ALU_NAMES:
            raise VTAProgramError(f"instruction {k} ({isa.describe(insn)}): unknown ALU opcode {insn.alu_opcode}")
        if self.hardware and insn.alu_opcode == isa.ALU_MUL:
            raise self._refuse(k, insn, "ALU MUL (neither the FPGA nor the Chisel design has it)",
                               "expected MIN, MAX, ADD or SHR")
        dst_u, src_u, _ = (a[insn.uop_bgn : insn.uop_end] for a in self._uops())
        self.counters.alu_counter += insn.iter_out * insn.iter_in * (insn.uop_end - insn.uop_bgn)
        dst, src = self._indices(
            k,
            insn,
            [
                (dst_u, insn.dst_factor_out, insn.dst_factor_in, cfg.acc_depth, "acc"),
                (src_u, insn.src_factor_out, insn.src_factor_in, cfg.acc_depth, "acc"),
            ],
        )
        self._guard(k, insn, self._acc_r, dst, vc[_M["store"]], "ALU writes accumulators a STORE may still read")
        self._acc_w[dst] = now
        op = insn.alu_opcode
        if self.hardware and op == isa.ALU_SHR:
            self._check_shift(k, insn, None if insn.use_imm else src)
        if insn.use_imm:
            if op == isa.ALU_SHR and abs(insn.imm) >= cfg.acc_width:
                raise VTAProgramError(f"instruction {k} ({isa.describe(insn)}): shift by {insn.imm}; expected |imm| < {cfg.acc_width}")
            if np.unique(dst).size == dst.size:
                self.acc[dst] = _alu_op(op, self.acc[dst], np.int32(insn.imm))
            else:
                for d in dst:
                    self.acc[d] = _alu_op(op, self.acc[d], np.int32(insn.imm))
            self._wrote(dst)
            return
        self._alu_vector(op, dst, src)
        self._wrote(dst)

    def _wrote(self, idx: np.ndarray) -> None:
        """GEMM/ALU results reach the output buffer (the FPGA design's ``out_mem``) as they finish."""
        self.out[idx] = self.acc[idx].astype(np.int8)
        self._out_valid[idx] = True

    def _check_shift(self, k: int, insn: isa.AluInsn, src: Optional[np.ndarray]) -> None:
        """Shift amounts both hardware designs execute as the functional simulator does."""
        if src is None:
            if not SHIFT_MIN <= insn.imm <= SHIFT_MAX:
                raise self._refuse(k, insn, f"shift by {insn.imm}, outside the FPGA design's signed 5-bit range "
                                   f"{SHIFT_MIN}..{SHIFT_MAX}", "expected the shift split into several SHR instructions")
            return
        lanes = self.acc[np.unique(src)]
        if lanes.size and (lanes.min() < SHIFT_MIN or lanes.max() > SHIFT_MAX):
            bad = int(lanes[(lanes < SHIFT_MIN) | (lanes > SHIFT_MAX)][0])
            raise self._refuse(k, insn, f"a lane shifts by {bad}, outside the FPGA design's signed 5-bit range "
                               f"{SHIFT_MIN}..{SHIFT_MAX}", "expected the shift split into several SHR instructions")
        left = insn.imm < 0  # the Chisel design: the immediate's sign bit picks left shifts for every lane
        if lanes.size and ((left and lanes.max() > 0) or (not left and lanes.min() < 0)):
            bad = int(lanes.max() if left else lanes.min())
            raise self._refuse(k, insn, f"a lane shifts by {bad} but the immediate's sign bit selects "
                               f"{'left' if left else 'right'} shifts for all lanes (the Chisel design)",
                               "expected the lanes of one vector SHR to share one sign, and imm < 0 for left shifts")

    def _alu_vector(self, op: int, dst: np.ndarray, src: np.ndarray) -> None:
        if self._vectorisable(dst, src):
            self.acc[dst] = _alu_op(op, self.acc[dst], self.acc[src])
        else:  # an iteration reads what an earlier one wrote: keep VTA's sequential order
            for d, s_ in zip(dst, src):
                self.acc[d] = _alu_op(op, self.acc[d], self.acc[s_])

    @staticmethod
    def _vectorisable(dst: np.ndarray, src: np.ndarray) -> bool:
        """True when all destinations differ and no step reads an element an earlier step wrote."""
        if np.unique(dst).size != dst.size:
            return False
        order = np.argsort(dst, kind="stable")
        sd = dst[order]
        pos = np.searchsorted(sd, src)
        hit = (pos < sd.size) & (sd[np.minimum(pos, sd.size - 1)] == src)
        writer = order[np.minimum(pos, sd.size - 1)]
        return not np.any(hit & (writer < np.arange(src.size)))

    def stats(self) -> dict[str, int]:
        """The counters so far (``vta.simulator.profiler_status``)."""
        return self.counters.to_dict()

    def clear_stats(self) -> None:
        self.counters = Counters()


def _alu_op(op: int, a: np.ndarray, b) -> np.ndarray:
    a = np.asarray(a, dtype=np.int32)
    b = np.asarray(b, dtype=np.int32)
    with np.errstate(over="ignore"):
        if op == isa.ALU_MIN:
            return np.minimum(a, b)
        if op == isa.ALU_MAX:
            return np.maximum(a, b)
        if op == isa.ALU_ADD:
            return (a.astype(np.int64) + b).astype(np.int32)
        if op == isa.ALU_MUL:
            return (a.astype(np.int64) * b).astype(np.int32)
        # SHR: arithmetic right shift, left shift for negative amounts
        bb = np.broadcast_to(b, a.shape).astype(np.int64)
        if np.any(np.abs(bb) >= 32):
            raise VTAProgramError(f"ALU SHR by {int(bb[np.abs(bb) >= 32].reshape(-1)[0])}; expected |amount| < 32")
        a64 = a.astype(np.int64)
        return np.where(bb >= 0, a64 >> np.maximum(bb, 0), a64 << np.maximum(-bb, 0)).astype(np.int32)
