"""The VTA simulator: small LOAD/GEMM/ALU/STORE programs against numpy, token misuse (programs with
acc8 loads, MUL or stores of loaded accumulators run in the functional mode, upstream's sim_driver.cc)."""

import numpy as np
import pytest

from tvm_layerfuse.runtime.vta import isa
from tvm_layerfuse.runtime.vta.config import DEFAULT
from tvm_layerfuse.runtime.vta.sim import (
    DRAM,
    DeadlockError,
    HazardError,
    Simulator,
    VTAProgramError,
)

B = DEFAULT.block


def _place(dram: DRAM, array: np.ndarray, elem_bytes: int) -> int:
    """Write ``array`` to DRAM; its address in units of ``elem_bytes``."""
    addr = dram.alloc(array.nbytes, align=256)
    dram.write(addr, array)
    return addr // elem_bytes


def _gemm_program(rng, *, relu_shift: int = 0, residual: bool = False):
    """acc[r] = sum_k X[r, k-block] . W[k-block]^T  for 4 rows and 2 input blocks, then
    (+ bias via register ADD) (+ residual via acc8 LOAD) >> shift, ReLU, clamp, STORE."""
    dram = DRAM()
    rows, kb = 4, 2
    x = rng.integers(-128, 128, size=(kb, rows, B), dtype=np.int8)  # [k-block, row, 16]
    w = rng.integers(-128, 128, size=(kb, B, B), dtype=np.int8)  # [k-block, out, in]
    bias = rng.integers(-5000, 5000, size=(1, B), dtype=np.int32)
    res = rng.integers(-128, 128, size=(rows, B), dtype=np.int8)
    x_a = _place(dram, x, 16)
    w_a = _place(dram, w, 256)
    b_a = _place(dram, bias, 64)
    r_a = _place(dram, res, 16)
    out_a = _place(dram, np.zeros((rows, B), np.int8), 16)
    # uops: [0] GEMM  dst=row(0)  src=kblock*rows  wgt=kblock   (loops: out=k-block, in=row)
    #       [1] reset dst=0;  [2] ALU dst=0 src=bias slot; [3] ALU dst=0 src=residual slot
    bias_slot, res_slot = rows, rows + 1
    uops = isa.encode_uops([isa.Uop(0, 0, 0), isa.Uop(0, 0, 0), isa.Uop(0, bias_slot, 0), isa.Uop(0, res_slot, 0)])
    u_a = _place(dram, uops, 4)
    prog = [
        isa.MemInsn(memory_type=isa.MEM_INP, sram_base=0, dram_base=x_a, y_size=1, x_size=kb * rows, x_stride=kb * rows),
        isa.MemInsn(memory_type=isa.MEM_WGT, sram_base=0, dram_base=w_a, y_size=1, x_size=kb, x_stride=kb, push_next=True),
        isa.MemInsn(memory_type=isa.MEM_UOP, sram_base=0, dram_base=u_a, y_size=1, x_size=4, x_stride=4),
        isa.MemInsn(memory_type=isa.MEM_ACC, sram_base=bias_slot, dram_base=b_a, y_size=1, x_size=1, x_stride=1),
        isa.GemmInsn(reset_reg=True, uop_bgn=1, uop_end=2, iter_out=1, iter_in=rows, dst_factor_in=1, pop_prev=True),
        isa.GemmInsn(uop_bgn=0, uop_end=1, iter_out=kb, iter_in=rows, dst_factor_in=1, src_factor_out=rows,
                     src_factor_in=1, wgt_factor_out=1),
        isa.AluInsn(uop_bgn=2, uop_end=3, iter_in=rows, dst_factor_in=1, alu_opcode=isa.ALU_ADD),
    ]
    expect = np.einsum("krj,koj->ro", x.astype(np.int64), w.astype(np.int64)) + bias
    if residual:
        prog.append(isa.MemInsn(memory_type=isa.MEM_ACC_8BIT, sram_base=res_slot, dram_base=r_a, y_size=1, x_size=1, x_stride=1))
        # each row adds its own residual row: load all rows after the accumulators instead
        prog[-1] = isa.MemInsn(memory_type=isa.MEM_ACC_8BIT, sram_base=res_slot, dram_base=r_a, y_size=1, x_size=rows, x_stride=rows)
        prog.append(isa.AluInsn(uop_bgn=3, uop_end=4, iter_in=rows, dst_factor_in=1, src_factor_in=1, alu_opcode=isa.ALU_ADD))
        expect = expect + res
    if relu_shift:
        prog.append(isa.AluInsn(uop_bgn=1, uop_end=2, iter_in=rows, dst_factor_in=1, alu_opcode=isa.ALU_SHR, use_imm=True, imm=relu_shift))
        prog.append(isa.AluInsn(uop_bgn=1, uop_end=2, iter_in=rows, dst_factor_in=1, alu_opcode=isa.ALU_MAX, use_imm=True, imm=0))
        prog.append(isa.AluInsn(uop_bgn=1, uop_end=2, iter_in=rows, dst_factor_in=1, alu_opcode=isa.ALU_MIN, use_imm=True, imm=127))
        expect = np.clip(expect >> relu_shift, 0, 127)
    prog[-1] = _with(prog[-1], push_next=True)
    prog += [
        isa.MemInsn(opcode=isa.OP_STORE, memory_type=isa.MEM_OUT, sram_base=0, dram_base=out_a, y_size=1, x_size=rows,
                    x_stride=rows, pop_prev=True, push_prev=True),
        isa.FinishInsn(pop_next=True),
    ]
    truncated = expect.astype(np.int64).astype(np.int32).astype(np.int8)  # STORE keeps the low 8 bits
    return dram, prog, out_a, truncated


def _with(insn, **kw):
    import dataclasses

    return dataclasses.replace(insn, **kw)


@pytest.mark.parametrize("shift, residual", [(0, False), (9, False), (7, True)])
def test_gemm_alu_store_against_numpy(shift, residual):
    rng = np.random.default_rng(shift)
    dram, prog, out_a, expect = _gemm_program(rng, relu_shift=shift, residual=residual)
    sim = Simulator(DEFAULT, dram, mode="functional" if residual else "hardware")
    stats = sim.run(isa.encode_stream(prog))  # through the bytes VTA would fetch
    got = dram.read(out_a * 16, expect.size).view(np.int8).reshape(expect.shape)
    np.testing.assert_array_equal(got, expect)
    assert stats.gemm_counter == 2 * 4 and stats.out_store_nbytes == 4 * 16
    assert stats.inp_load_nbytes == 8 * 16 and stats.wgt_load_nbytes == 2 * 256 and stats.uop_load_nbytes == 16
    assert stats.insn_finish == 1 and stats.insn_store == 1


def test_load_padding_and_strides():
    rng = np.random.default_rng(1)
    dram = DRAM()
    img = rng.integers(-128, 128, size=(5, 7, B), dtype=np.int8)  # [H, W, 16]
    a = _place(dram, img, 16)
    out_a = _place(dram, np.zeros((4, 6, B), np.int8), 16)
    # rows 1..3, columns 2..5 of the image with 1 zero row above, 2 below, 1 zero column left
    load = isa.MemInsn(memory_type=isa.MEM_ACC_8BIT, sram_base=0, dram_base=a + 1 * 7 + 2, y_size=3, x_size=4,
                       x_stride=7, y_pad_0=1, y_pad_1=2, x_pad_0=1, x_pad_1=1)
    # 6 x 6 padded block lands in acc[0:36]; store its 6 x 6 (rows 0..3) into a 4 x 6 region
    prog = [
        _with(load, push_next=True),
        isa.MemInsn(opcode=isa.OP_STORE, memory_type=isa.MEM_OUT, sram_base=0, dram_base=out_a, y_size=4, x_size=6,
                    x_stride=6, pop_prev=True, push_prev=True),
        isa.FinishInsn(pop_next=True),
    ]
    Simulator(DEFAULT, dram, mode="functional").run(prog)
    expect = np.zeros((6, 6, B), np.int8)
    expect[1:4, 1:5] = img[1:4, 2:6]
    got = dram.read(out_a * 16, 4 * 6 * B).view(np.int8).reshape(4, 6, B)
    np.testing.assert_array_equal(got, expect[:4])


def test_alu_register_ops_and_sequential_dependence():
    """An ALU step that reads what an earlier step of the same instruction wrote (a running sum)."""
    dram = DRAM()
    vals = np.arange(4 * B, dtype=np.int32).reshape(4, B) - 20
    a = _place(dram, vals, 64)
    uops = isa.encode_uops([isa.Uop(1, 0, 0)])
    u = _place(dram, uops, 4)
    out_a = _place(dram, np.zeros((4, B), np.int8), 16)
    prog = [
        isa.MemInsn(memory_type=isa.MEM_UOP, sram_base=0, dram_base=u, y_size=1, x_size=1, x_stride=1),
        isa.MemInsn(memory_type=isa.MEM_ACC, sram_base=0, dram_base=a, y_size=1, x_size=4, x_stride=4),
        # acc[1+i] += acc[0+i] for i = 0..2: prefix sums, each step sees the previous result
        isa.AluInsn(uop_bgn=0, uop_end=1, iter_in=3, dst_factor_in=1, src_factor_in=1, alu_opcode=isa.ALU_ADD, push_next=True),
        isa.MemInsn(opcode=isa.OP_STORE, memory_type=isa.MEM_OUT, sram_base=0, dram_base=out_a, y_size=1, x_size=4,
                    x_stride=4, pop_prev=True, push_prev=True),
        isa.FinishInsn(pop_next=True),
    ]
    Simulator(DEFAULT, dram, mode="functional").run(prog)  # acc[0] is stored as loaded
    got = dram.read(out_a * 16, 4 * B).view(np.int8).reshape(4, B)
    np.testing.assert_array_equal(got, np.cumsum(vals, axis=0).astype(np.int8))


def test_shr_negative_shifts_left_and_mul():
    dram = DRAM()
    vals = np.array([[-7, 5, 100, -128] * (B // 4)], np.int32)
    a = _place(dram, vals, 64)
    u = _place(dram, isa.encode_uops([isa.Uop(0, 0, 0)]), 4)
    out_a = _place(dram, np.zeros((1, B), np.int8), 16)
    prog = [
        isa.MemInsn(memory_type=isa.MEM_UOP, sram_base=0, dram_base=u, y_size=1, x_size=1, x_stride=1),
        isa.MemInsn(memory_type=isa.MEM_ACC, sram_base=0, dram_base=a, y_size=1, x_size=1, x_stride=1),
        isa.AluInsn(uop_bgn=0, uop_end=1, alu_opcode=isa.ALU_SHR, use_imm=True, imm=-2),
        isa.AluInsn(uop_bgn=0, uop_end=1, alu_opcode=isa.ALU_MUL, use_imm=True, imm=3),
        isa.AluInsn(uop_bgn=0, uop_end=1, alu_opcode=isa.ALU_SHR, use_imm=True, imm=3, push_next=True),
        isa.MemInsn(opcode=isa.OP_STORE, memory_type=isa.MEM_OUT, sram_base=0, dram_base=out_a, y_size=1, x_size=1,
                    x_stride=1, pop_prev=True, push_prev=True),
        isa.FinishInsn(pop_next=True),
    ]
    Simulator(DEFAULT, dram, mode="functional").run(prog)
    got = dram.read(out_a * 16, B).view(np.int8)
    np.testing.assert_array_equal(got, ((vals[0] * 4 * 3) >> 3).astype(np.int8))


def test_popping_a_token_never_pushed_is_a_deadlock():
    rng = np.random.default_rng(0)
    dram, prog, _, _ = _gemm_program(rng)
    prog[1] = _with(prog[1], push_next=False)  # the load never signals the compute module
    with pytest.raises(DeadlockError, match="compute module at instruction 4 .* waits for a load->compute token"):
        Simulator(DEFAULT, dram).run(prog)


def test_missing_token_is_a_hazard_not_a_wrong_result():
    rng = np.random.default_rng(0)
    dram, prog, _, _ = _gemm_program(rng)
    prog[1] = _with(prog[1], push_next=False)
    prog[4] = _with(prog[4], pop_prev=False)  # compute no longer waits for its inputs
    with pytest.raises(HazardError, match="GEMM reads input elements a LOAD may still write"):
        Simulator(DEFAULT, dram).run(prog)
    dram, prog, _, _ = _gemm_program(rng)
    prog[-3] = _with(prog[-3], push_next=False)  # the store does not wait for the epilogue
    prog[-2] = _with(prog[-2], pop_prev=False)
    with pytest.raises(HazardError, match="STORE reads accumulators"):
        Simulator(DEFAULT, dram).run(prog)


def test_finish_must_wait_for_store_and_tokens_balance():
    rng = np.random.default_rng(0)
    dram, prog, _, _ = _gemm_program(rng)
    prog[-2] = _with(prog[-2], push_prev=False)
    prog[-1] = _with(prog[-1], pop_next=False)
    with pytest.raises(HazardError, match="FINISH may complete before STORE"):
        Simulator(DEFAULT, dram).run(prog)
    dram, prog, _, _ = _gemm_program(rng)
    prog[-1] = _with(prog[-1], push_prev=True)  # a compute->load token the load module never pops
    with pytest.raises(DeadlockError, match="unconsumed dependency tokens \\(1 in compute->load\\)"):
        Simulator(DEFAULT, dram).run(prog)
    with pytest.raises(VTAProgramError, match="no push_next queue"):
        Simulator(DEFAULT, dram).run([isa.MemInsn(opcode=isa.OP_STORE, memory_type=isa.MEM_OUT, push_next=True), isa.FinishInsn()])


def test_out_of_range_access_is_an_error():
    dram = DRAM(1024)
    with pytest.raises(VTAProgramError, match="inp buffer holds 2048"):
        load = isa.MemInsn(memory_type=isa.MEM_INP, sram_base=2040, y_size=1, x_size=16, x_stride=16)
        Simulator(DEFAULT, dram).run([load, isa.FinishInsn()])


def test_relocated_program_computes_the_same_at_another_base():
    rng = np.random.default_rng(5)
    dram, prog, out_a, expect = _gemm_program(rng, relu_shift=9, residual=True)
    base = 1 << 20  # the image moved to 1 MiB, as a board driver places it
    moved = DRAM(base + dram.data.size)
    moved.write(base, dram.data)
    Simulator(DEFAULT, moved, mode="functional").run(isa.relocate(prog, base))
    got = moved.read(base + out_a * 16, expect.size).view(np.int8).reshape(expect.shape)
    np.testing.assert_array_equal(got, expect)
    with pytest.raises(isa.ISAError, match="not a multiple"):
        isa.relocate(prog, 8)


# ---------------------------------------------------------------------- against hw_spec.h's loop nest
import functools  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402


@functools.lru_cache(maxsize=1)
def _small_cfg():
    from tvm_layerfuse.runtime.vta.config import config_from_dict

    return config_from_dict({"LOG_BLOCK": 2, "LOG_INP_BUFF_SIZE": 10, "LOG_WGT_BUFF_SIZE": 10,
                             "LOG_ACC_BUFF_SIZE": 10, "LOG_UOP_BUFF_SIZE": 10})


@settings(max_examples=40, deadline=None)
@given(seed=hst.integers(0, 2**31 - 1), alu=hst.booleans(), use_imm=hst.booleans(), op=hst.sampled_from([0, 1, 2, 3, 4]))
def test_gemm_and_alu_match_the_sequential_loop_nest(seed, alu, use_imm, op):
    """Random micro-ops and loop factors (overlapping destinations, reads of earlier writes):
    the vectorised simulator equals hw_spec.h's sequential loop, step by step."""
    cfg = _small_cfg()  # block 4; indices drawn from a few elements so that steps collide
    rng = np.random.default_rng(seed)
    sim = Simulator(cfg, DRAM(16), mode="functional")  # MUL, any shift
    sim.inp[:] = rng.integers(-128, 128, sim.inp.shape)
    sim.wgt[:] = rng.integers(-128, 128, sim.wgt.shape)
    sim.acc[:] = rng.integers(-1000, 1000, sim.acc.shape)
    n_uops = int(rng.integers(1, 4))
    uops = [isa.Uop(int(rng.integers(0, 6)), int(rng.integers(0, 6)), int(rng.integers(0, min(6, cfg.wgt_depth)))) for _ in range(n_uops)]
    words = isa.encode_uops(uops, cfg)
    sim.uop_words[: len(words)] = words
    sim._uop_cache = None
    it_o, it_i = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    f = [int(rng.integers(0, 3)) for _ in range(6)]
    acc0 = sim.acc.copy().astype(np.int64)
    if alu:
        imm = int(rng.integers(-4, 5)) if op == isa.ALU_SHR else int(rng.integers(-300, 300))
        insn = isa.AluInsn(uop_bgn=0, uop_end=n_uops, iter_out=it_o, iter_in=it_i, dst_factor_out=f[0], dst_factor_in=f[1],
                           src_factor_out=f[2], src_factor_in=f[3], alu_opcode=op, use_imm=use_imm, imm=imm)
        if not use_imm and op == isa.ALU_SHR:
            sim.acc[:] = rng.integers(0, 4, sim.acc.shape)  # right shifts of small values stay valid shift amounts
            acc0 = sim.acc.copy().astype(np.int64)
    else:
        insn = isa.GemmInsn(uop_bgn=0, uop_end=n_uops, iter_out=it_o, iter_in=it_i, dst_factor_out=f[0], dst_factor_in=f[1],
                            src_factor_out=f[2], src_factor_in=f[3], wgt_factor_out=f[4] % 2, wgt_factor_in=f[5] % 2)
    expect = acc0.copy()
    for o in range(it_o):
        for i in range(it_i):
            for u in uops:
                d = u.dst_idx + o * insn.dst_factor_out + i * insn.dst_factor_in
                s = u.src_idx + o * insn.src_factor_out + i * insn.src_factor_in
                if alu:
                    y = insn.imm if use_imm else expect[s].copy()
                    x = expect[d]
                    expect[d] = {0: np.minimum(x, y), 1: np.maximum(x, y), 2: x + y,
                                 3: np.where(np.asarray(y) >= 0, x >> np.maximum(y, 0), x << np.maximum(-np.asarray(y), 0)),
                                 4: x * y}[op]
                else:
                    w = u.wgt_idx + o * insn.wgt_factor_out + i * insn.wgt_factor_in
                    expect[d] += sim.wgt[w].astype(np.int64) @ sim.inp[s].astype(np.int64)
                expect[d] = expect[d].astype(np.int32)  # 32-bit accumulators wrap
    sim._prepare_hazards()
    (sim._alu if alu else sim._gemm)(0, insn, [0, 0, 0], 1)
    np.testing.assert_array_equal(sim.acc, expect.astype(np.int32))
