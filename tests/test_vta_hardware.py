"""The simulator's hardware mode: what the VTA hardware designs (the FPGA design's vta.cc, the
Chisel design) execute. Each illegal form is refused in one line naming program and
instruction; the generated residual, element-wise and copy programs run bit-exact under it."""

import dataclasses

import numpy as np
import pytest

from tvm_layerfuse.runtime.vta import isa
from tvm_layerfuse.runtime.vta.config import DEFAULT
from tvm_layerfuse.runtime.vta.sim import DRAM, HardwareError, Simulator

B = DEFAULT.block


def _place(dram: DRAM, array: np.ndarray, elem_bytes: int) -> int:
    addr = dram.alloc(array.nbytes, align=256)
    dram.write(addr, array)
    return addr // elem_bytes


class _Prog:
    """A one-step program: uop load, ``body`` on the compute module, STORE of ``n`` elements."""

    def __init__(self, seed: int = 0, n: int = 4) -> None:
        rng = np.random.default_rng(seed)
        self.dram, self.n = DRAM(), n
        self.acc = rng.integers(-3000, 3000, size=(n, B), dtype=np.int32)
        self.x = rng.integers(-128, 128, size=(n, B), dtype=np.int8)
        self.a_acc = _place(self.dram, self.acc, 64)
        self.a_x = _place(self.dram, self.x, 16)
        self.a_eye = _place(self.dram, np.eye(B, dtype=np.int8), 256)
        self.a_out = _place(self.dram, np.zeros((n, B), np.int8), 16)
        # uops: 0 = (acc 0, inp 0, wgt 0); 1 = ALU src n (a shift vector after the tile)
        self.a_uop = _place(self.dram, isa.encode_uops([isa.Uop(0, 0, 0), isa.Uop(0, n, 0)]), 4)

    def uop(self) -> isa.MemInsn:
        return isa.MemInsn(memory_type=isa.MEM_UOP, dram_base=self.a_uop, y_size=1, x_size=2, x_stride=2)

    def load_acc(self) -> isa.MemInsn:
        return isa.MemInsn(memory_type=isa.MEM_ACC, dram_base=self.a_acc, y_size=1, x_size=self.n, x_stride=self.n)

    def alu(self, op: int, **kw) -> isa.AluInsn:
        return isa.AluInsn(uop_bgn=0, uop_end=1, iter_in=self.n, dst_factor_in=1, alu_opcode=op, **kw)

    def program(self, body: list, *, loads: list = ()) -> list:
        body = list(body)
        loads = list(loads)
        if loads:
            loads[-1] = dataclasses.replace(loads[-1], push_next=True)
        first = dataclasses.replace(self.uop(), pop_prev=bool(loads))
        body[-1] = dataclasses.replace(body[-1], push_next=True)
        store = isa.MemInsn(opcode=isa.OP_STORE, memory_type=isa.MEM_OUT, dram_base=self.a_out, y_size=1, x_size=self.n,
                            x_stride=self.n, pop_prev=True, push_prev=True)
        return loads + [first] + body + [store, isa.FinishInsn(pop_next=True)]

    def run(self, prog: list, mode: str = "hardware") -> np.ndarray:
        dram = DRAM()
        dram.data, dram.top = self.dram.data.copy(), self.dram.top
        Simulator(DEFAULT, dram, mode=mode).run(prog, name="p7")
        return dram.read(self.a_out * 16, self.n * B).view(np.int8).reshape(self.n, B)


def _refused(prog: _Prog, insns: list, k: int, match: str) -> HardwareError:
    with pytest.raises(HardwareError, match=match) as e:
        prog.run(insns)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"VTA program 'p7', instruction {k} (")
    return e.value


def test_a_legal_program_gives_the_functional_result():
    p = _Prog()
    prog = p.program([p.load_acc(), p.alu(isa.ALU_SHR, use_imm=True, imm=3), p.alu(isa.ALU_MAX, use_imm=True, imm=-100)])
    hw = p.run(prog)
    np.testing.assert_array_equal(hw, p.run(prog, "functional"))
    np.testing.assert_array_equal(hw, np.maximum(p.acc >> 3, -100).astype(np.int8))


def test_acc8_load_is_refused():
    p = _Prog()
    acc8 = isa.MemInsn(memory_type=isa.MEM_ACC_8BIT, dram_base=p.a_x, y_size=1, x_size=p.n, x_stride=p.n)
    prog = p.program([acc8, p.alu(isa.ALU_ADD, use_imm=True, imm=0)])
    _refused(p, prog, 1, "LOAD acc8 exists only in the functional simulator")
    np.testing.assert_array_equal(p.run(prog, "functional"), p.x)  # sim_driver.cc's sign-extending load


def test_store_of_accumulators_no_gemm_or_alu_wrote_is_refused():
    p = _Prog()
    load_only = p.program([p.load_acc()])
    _refused(p, load_only, 2, "STORE of accumulator 0, which no GEMM or ALU wrote since it was loaded or reset")
    np.testing.assert_array_equal(p.run(load_only, "functional"), p.acc.astype(np.int8))
    # written, then loaded again: the output buffer holds the ALU's value, not the new load
    stale = p.program([p.load_acc(), p.alu(isa.ALU_ADD, use_imm=True, imm=1), p.load_acc()])
    _refused(p, stale, 4, "STORE of accumulator 0")
    # a GEMM reset leaves old + dot product in the FPGA design's output buffer
    reset = p.program([isa.GemmInsn(reset_reg=True, uop_bgn=0, uop_end=1, iter_in=p.n, dst_factor_in=1)])
    _refused(p, reset, 2, "STORE of accumulator 0")


def test_identity_gemm_brings_int8_data_into_the_accumulators():
    """VTA's hardware way of LOAD acc8: LOAD inp, GEMM reset, GEMM with an identity weight block."""
    p = _Prog()
    loads = [isa.MemInsn(memory_type=isa.MEM_INP, dram_base=p.a_x, y_size=1, x_size=p.n, x_stride=p.n),
             isa.MemInsn(memory_type=isa.MEM_WGT, dram_base=p.a_eye, y_size=1, x_size=1, x_stride=1)]
    body = [isa.GemmInsn(reset_reg=True, uop_bgn=0, uop_end=1, iter_in=p.n, dst_factor_in=1),
            isa.GemmInsn(uop_bgn=0, uop_end=1, iter_in=p.n, dst_factor_in=1, src_factor_in=1)]
    np.testing.assert_array_equal(p.run(p.program(body, loads=loads)), p.x)


@pytest.mark.parametrize("imm", [16, 20, -17, 31])
def test_immediate_shift_outside_minus_16_to_15_is_refused(imm):
    p = _Prog()
    prog = p.program([p.load_acc(), p.alu(isa.ALU_SHR, use_imm=True, imm=imm)])
    _refused(p, prog, 2, f"shift by {imm}, outside the FPGA design's signed 5-bit range -16..15")
    p.run(prog, "functional")  # sim_driver.cc shifts by any |amount| < 32


def _vector_shr(p: _Prog, lanes: np.ndarray, imm: int) -> list:
    """acc[0:n] >>= acc[n] (one shift vector for every row), vector mode, ``imm`` the sign carrier."""
    a_vec = _place(p.dram, np.broadcast_to(lanes.astype(np.int32), (1, B)).copy(), 64)
    load_vec = isa.MemInsn(memory_type=isa.MEM_ACC, sram_base=p.n, dram_base=a_vec, y_size=1, x_size=1, x_stride=1)
    shr = isa.AluInsn(uop_bgn=1, uop_end=2, iter_in=p.n, dst_factor_in=1, alu_opcode=isa.ALU_SHR, imm=imm)
    return p.program([p.load_acc(), load_vec, shr])


def test_vector_shift_lane_outside_the_range_is_refused():
    p = _Prog()
    _refused(p, _vector_shr(p, np.full(B, 20), 0), 3, "a lane shifts by 20, outside the FPGA design's signed 5-bit range")


@pytest.mark.parametrize("lanes, imm, bad", [(-(np.arange(B) % 8), 0, -7), (np.arange(B) % 8, -1, 7)])
def test_vector_shift_lanes_must_agree_with_the_immediate_sign(lanes, imm, bad):
    """The Chisel design shifts every lane left when the immediate's sign bit is set, right otherwise."""
    p = _Prog()
    _refused(p, _vector_shr(p, lanes, imm), 3, f"a lane shifts by {bad} but the immediate's sign bit selects")
    legal = _vector_shr(p, lanes, -1 if lanes.min() < 0 else 0)
    expect = np.where(lanes >= 0, p.acc >> np.maximum(lanes, 0), p.acc << np.maximum(-lanes, 0)).astype(np.int8)
    np.testing.assert_array_equal(p.run(legal), expect)


def test_mul_is_refused():
    p = _Prog()
    _refused(p, p.program([p.load_acc(), p.alu(isa.ALU_MUL, use_imm=True, imm=3)]), 2, "ALU MUL")


def test_weight_padding_is_refused():
    p = _Prog()
    padded = isa.MemInsn(memory_type=isa.MEM_WGT, dram_base=p.a_eye, y_size=1, x_size=1, x_stride=1, x_pad_1=1)
    _refused(p, p.program([p.load_acc(), p.alu(isa.ALU_ADD, use_imm=True, imm=0)], loads=[padded]), 0,
             "a weight LOAD with padding")


def test_uop_load_of_several_rows_is_refused():
    p = _Prog()
    prog = p.program([p.load_acc(), p.alu(isa.ALU_ADD, use_imm=True, imm=0)])
    prog[0] = dataclasses.replace(prog[0], y_size=2, x_size=1, x_stride=1)
    _refused(p, prog, 0, "a micro-op LOAD of several rows")


# ---------------------------------------------------------------------- the generated programs
def test_shift_parts_stay_in_range_with_one_sign_each():
    from tvm_layerfuse.compile.vta.codegen import shift_parts

    amount = np.array([30, -30, 0, 15, -16, 17, -17, 1])
    parts = shift_parts(amount)
    assert len(parts) == 4
    for a, left in parts:
        assert a.min() >= -16 and a.max() <= 15
        assert (a <= 0).all() if left else (a >= 0).all()
    np.testing.assert_array_equal(sum(a for a, _ in parts), amount)


@pytest.mark.parametrize("shift", [1, 7, 15, 16, 23, 30, -5, -16, -20])
def test_requantization_split_equals_one_rounding_shift(shift):
    """``(a + 2**(s-1)) >> s`` in SHR instructions of at most 15 (the rounding before the last)."""
    from tvm_layerfuse.compile.vta.codegen import _requantize

    p = _Prog(seed=shift % 7)
    rng = np.random.default_rng(shift + 100)
    vals = rng.integers(-(2**31), 2**31 - 1, size=(p.n, B), dtype=np.int64)
    if shift < 0:
        vals >>= 24  # left shifts of small values stay in int32
    p.acc[:] = vals.astype(np.int32)
    p.dram.write(p.a_acc * 64, p.acc)
    step = {"compute": []}
    _requantize(step, 0, 1, p.n, 0, shift)
    assert all(-16 <= i.imm <= 15 for i in step["compute"] if i.alu_opcode == isa.ALU_SHR)
    got = p.run(p.program([p.load_acc()] + step["compute"]))
    a = p.acc.astype(np.int64)
    expect = (a + (1 << (shift - 1))) >> shift if shift > 0 else a << -shift
    np.testing.assert_array_equal(got, expect.astype(np.int32).astype(np.int8))


def _residual_net():
    from tvm_layerfuse.testing._builder import NetBuilder

    nb = NetBuilder("residual", seed=3, opset=13, bn="separate", clip="inputs", quirks=False)
    x = nb.input("input", (1, 16, 8, 8))
    a = nb.relu(nb.conv_bn(x, 16, 3, pad=1))
    y = nb.relu(nb.add(nb.conv_bn(a, 16, 3, pad=1), a))
    return nb.build({"output": nb.relu(nb.conv_bn(y, 32, 1))})


@pytest.fixture(scope="module")
def residual_build():
    from tvm_layerfuse.compile.vta import pipeline

    return pipeline.build(_residual_net(), baseline=True, n_calibration=2, seed=1)


def _hardware_legal(compiled) -> None:
    """No program holds a form only the functional simulator runs (static, before running)."""
    for name, prog in compiled.programs.items():
        for insn in prog.insns:
            assert not (isinstance(insn, isa.MemInsn) and insn.memory_type == isa.MEM_ACC_8BIT), name
            if isinstance(insn, isa.AluInsn):
                assert insn.alu_opcode != isa.ALU_MUL, name
                assert not insn.use_imm or insn.alu_opcode != isa.ALU_SHR or -16 <= insn.imm <= 15, name


@pytest.mark.parametrize("fused, kind", [(True, "conv"), (False, "eltwise")])
def test_residual_and_eltwise_programs_bit_exact_under_the_hardware_mode(residual_build, fused, kind):
    """The fused form adds the residual in the conv's epilogue; the unfused form runs the add
    and the ReLU as element-wise programs. Both bit-exact with the int8 numpy reference."""
    from tvm_layerfuse.compile.vta.executor import execute
    from tvm_layerfuse.compile.vta.graph import ConvOp, EltwiseOp
    from tvm_layerfuse.compile.vta.quantize import random_samples, reference

    b = residual_build
    compiled = b.fused if fused else b.unfused
    ops = compiled.graph.ops
    if fused:
        assert any(isinstance(op, ConvOp) and op.residual and op.on_vta for op in ops)
    else:
        elt = [op for op in ops if isinstance(op, EltwiseOp) and op.on_vta]
        assert any(len(op.inputs) == 2 for op in elt) and elt
    assert any(p.kind == kind for p in compiled.programs.values())
    _hardware_legal(compiled)
    for feeds in random_samples(compiled.graph, 2, seed=5):
        trace = {}
        ref = reference(compiled.graph, b.quantization, feeds, trace=trace)
        run = execute(compiled, feeds, trace=True, device="sim")
        for name, value in trace.items():
            np.testing.assert_array_equal(run.ints[name], value, err_msg=name)
        np.testing.assert_array_equal(run.outputs["output"], ref["output"])
        # the functional simulator agrees on these programs
        np.testing.assert_array_equal(execute(compiled, feeds, device="sim-functional").outputs["output"], ref["output"])


def test_a_refusal_names_the_network_op(residual_build):
    """Through the runtime, the program in the message is the op's name."""
    from tvm_layerfuse.compile.vta.executor import to_module
    from tvm_layerfuse.compile.vta.quantize import random_samples

    compiled = residual_build.unfused
    module = to_module(compiled)
    name, key = next((op["name"], op["program"]) for op in module.manifest["ops"] if op.get("program"))
    insns = isa.decode_stream(module.streams[key])
    k = next(k for k, i in enumerate(insns) if isinstance(i, isa.AluInsn))
    insns[k] = dataclasses.replace(insns[k], alu_opcode=isa.ALU_MUL)
    module.streams[key] = isa.encode_stream(insns)
    with pytest.raises(HardwareError, match=f"VTA program {name!r}, instruction {k} \\(ALU MUL"):
        module.run(random_samples(compiled.graph, 1, seed=1)[0])


def test_devices_choose_the_mode():
    """``sim`` is the hardware mode; the functional simulator only on request."""
    from tvm_layerfuse.errors import DeviceError
    from tvm_layerfuse.runtime.vta.runtime import open_device

    assert open_device("sim", DEFAULT).sim.mode == "hardware"
    assert open_device("sim-functional", DEFAULT).sim.mode == "functional"
    with pytest.raises(DeviceError, match="expected 'sim', 'sim-functional', 'board'"):
        open_device("fsim", DEFAULT)
    with pytest.raises(ValueError, match="simulator mode 'tsim' is unknown"):
        Simulator(DEFAULT, mode="tsim")
