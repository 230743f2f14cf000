"""VTA configuration and instruction encoding: round trips, field extremes, hand-made bit patterns."""

import json
import random

import numpy as np
import pytest

from tvm_layerfuse.errors import UsageError
from tvm_layerfuse.runtime.vta import isa
from tvm_layerfuse.runtime.vta.config import DEFAULT, VTAConfig, config_from_dict, load_config

SMALL_BUFFERS = {"LOG_INP_BUFF_SIZE": 14, "LOG_ACC_BUFF_SIZE": 16}


def test_default_config_sizes():
    cfg = DEFAULT
    assert (cfg.block, cfg.batch, cfg.inp_width, cfg.wgt_width, cfg.acc_width) == (16, 1, 8, 8, 32)
    assert (cfg.uop_depth, cfg.inp_depth, cfg.wgt_depth, cfg.acc_depth) == (8192, 2048, 1024, 2048)
    assert (cfg.log_uop_depth, cfg.log_inp_depth, cfg.log_wgt_depth, cfg.log_acc_depth) == (13, 11, 10, 11)
    assert (cfg.inp_elem_bytes, cfg.wgt_elem_bytes, cfg.acc_elem_bytes, cfg.out_elem_bytes) == (16, 256, 64, 16)


def test_config_from_json_file(tmp_path):
    path = tmp_path / "vta_config.json"
    path.write_text(json.dumps({"TARGET": "pynq", "HW_VER": "0.0.2", "LOG_INP_WIDTH": 3, "LOG_WGT_WIDTH": 3,
                                "LOG_ACC_WIDTH": 5, "LOG_BATCH": 0, "LOG_BLOCK": 4, "LOG_UOP_BUFF_SIZE": 15,
                                "LOG_INP_BUFF_SIZE": 15, "LOG_WGT_BUFF_SIZE": 18, "LOG_ACC_BUFF_SIZE": 17,
                                "LOG_BUS_WIDTH": 6}))
    cfg = load_config(path)
    assert cfg.TARGET == "pynq" and cfg.wgt_depth == 1024
    small = config_from_dict({"LOG_BLOCK_IN": 3, "LOG_BLOCK_OUT": 3, "LOG_WGT_BUFF_SIZE": 14, **SMALL_BUFFERS})
    assert small.block == 8 and small.wgt_depth == 256 and small.acc_depth == 2048


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"LOG_BLOCK": "4"}, "LOG_BLOCK is '4'; expected an integer"),
        ({"LOG_ACC_WIDTH": 4}, "LOG_ACC_WIDTH is 4; expected 5"),
        ({"LOG_BLOK": 4}, "unknown key(s) LOG_BLOK"),
        ({"LOG_BLOCK_IN": 4, "LOG_BLOCK_OUT": 3}, "differ; expected a square GEMM block"),
        ({"LOG_ACC_BUFF_SIZE": 24, "LOG_INP_BUFF_SIZE": 24}, "encoding needs"),
    ],
)
def test_config_errors_are_one_line(data, needle):
    with pytest.raises(UsageError) as exc:
        config_from_dict(data, source="cfg.json")
    msg = str(exc.value)
    assert needle in msg and "\n" not in msg and msg.startswith("cfg.json")


def test_config_file_not_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{LOG_BLOCK: 4")
    with pytest.raises(UsageError, match="is not valid JSON"):
        load_config(path)


def _rand_insn(rng: random.Random, cfg: VTAConfig, kind: str, extreme: str):
    lay = isa.layouts(cfg)
    fields = {"mem": lay["mem"], "gemm": lay["gemm"], "alu": lay["alu"], "finish": lay["finish"]}[kind]
    values = {}
    for name, _, width in fields:
        if name == "opcode":
            continue
        if name == "imm":
            lo, hi = -(1 << (width - 1)), (1 << (width - 1)) - 1
        else:
            lo, hi = 0, (1 << width) - 1
        if name == "memory_type":
            hi = 5
        if name == "alu_opcode":
            hi = 4
        values[name] = {"min": lo, "max": hi, "rand": rng.randint(lo, hi)}[extreme]
        if width == 1:
            values[name] = bool(values[name])
    if kind == "mem":
        return isa.MemInsn(opcode=rng.choice([isa.OP_LOAD, isa.OP_STORE]), **values)
    return {"gemm": isa.GemmInsn, "alu": isa.AluInsn, "finish": isa.FinishInsn}[kind](**values)


@pytest.mark.parametrize("kind", ["mem", "gemm", "alu", "finish"])
@pytest.mark.parametrize("extreme", ["min", "max", "rand"])
def test_round_trip_every_instruction_type(kind, extreme):
    rng = random.Random(7)
    for cfg in (DEFAULT, config_from_dict({"LOG_BLOCK": 3, "LOG_WGT_BUFF_SIZE": 15, **SMALL_BUFFERS})):
        for _ in range(20 if extreme == "rand" else 1):
            insn = _rand_insn(rng, cfg, kind, extreme)
            raw = isa.encode(insn, cfg)
            assert len(raw) == 16
            assert isa.decode(raw, cfg) == insn
    stream = [_rand_insn(rng, DEFAULT, k, "rand") for k in ("mem", "gemm", "alu", "finish")]
    assert isa.decode_stream(isa.encode_stream(stream)) == stream


def test_uop_round_trip_and_extremes():
    uops = [isa.Uop(0, 0, 0), isa.Uop(2047, 2047, 1023), isa.Uop(5, 1000, 3)]
    words = isa.encode_uops(uops)
    assert words[1] == 0xFFFFFFFF  # 11 + 11 + 10 bits fill the word exactly
    dst, src, wgt = isa.decode_uops(words)
    assert [isa.Uop(int(a), int(b), int(c)) for a, b, c in zip(dst, src, wgt)] == uops
    vec = isa.encode_uop_arrays(np.array([0, 2047, 5]), np.array([0, 2047, 1000]), np.array([0, 1023, 3]))
    assert np.array_equal(vec, words)
    with pytest.raises(isa.ISAError, match="wgt_idx"):
        isa.encode_uops([isa.Uop(0, 0, 1024)])


def test_field_overflow_is_refused():
    with pytest.raises(isa.ISAError, match="sram_base=65536"):
        isa.encode(isa.MemInsn(sram_base=1 << 16))
    with pytest.raises(isa.ISAError, match="imm=32768"):
        isa.encode(isa.AluInsn(imm=1 << 15))
    with pytest.raises(isa.ISAError, match="uop_end=16384"):
        isa.encode(isa.GemmInsn(uop_end=1 << 14))


def test_load_bit_pattern_from_hw_spec():
    # VTAMemInsn, by hand from hw_spec.h: word 0 = opcode[0:3] pop_prev[3] pop_next[4] push_prev[5]
    # push_next[6] memory_type[7:10] sram_base[10:26] dram_base[26:58]; y_size does not fit in
    # the 6 bits left, so word 1 = y_size[0:16] x_size[16:32] x_stride[32:48] y_pad_0[48:52]
    # y_pad_1[52:56] x_pad_0[56:60] x_pad_1[60:64].
    insn = isa.MemInsn(opcode=isa.OP_LOAD, pop_next=True, push_next=True, memory_type=isa.MEM_INP, sram_base=5,
                       dram_base=0x100, y_size=3, x_size=4, x_stride=10, y_pad_0=1, x_pad_1=2)
    word0 = 0 | (1 << 4) | (1 << 6) | (2 << 7) | (5 << 10) | (0x100 << 26)
    word1 = 3 | (4 << 16) | (10 << 32) | (1 << 48) | (2 << 60)
    assert isa.encode(insn) == word0.to_bytes(8, "little") + word1.to_bytes(8, "little")
    assert word0 == 0x0000_0004_0000_1550


def test_gemm_and_alu_bit_patterns_from_hw_spec():
    # VTAGemInsn, default config (uop depth 2^13, acc/inp 2^11, wgt 2^10): word 0 = head[0:7]
    # reset[7] uop_bgn[8:21] uop_end[21:35] iter_out[35:49] iter_in[49:63]; word 1 =
    # dst_out[0:11] dst_in[11:22] src_out[22:33] src_in[33:44] wgt_out[44:54] wgt_in[54:64].
    g = isa.GemmInsn(pop_prev=True, uop_bgn=1, uop_end=9, iter_out=2, iter_in=3, dst_factor_out=4,
                     dst_factor_in=5, src_factor_out=6, src_factor_in=7, wgt_factor_out=8, wgt_factor_in=9)
    w0 = 2 | (1 << 3) | (1 << 8) | (9 << 21) | (2 << 35) | (3 << 49)
    w1 = 4 | (5 << 11) | (6 << 22) | (7 << 33) | (8 << 44) | (9 << 54)
    assert isa.encode(g) == w0.to_bytes(8, "little") + w1.to_bytes(8, "little")
    # VTAAluInsn: word 1 = dst_out[0:11] dst_in[11:22] src_out[22:33] src_in[33:44]
    # alu_opcode[44:47] use_imm[47] imm[48:64] (two's complement)
    a = isa.AluInsn(push_next=True, uop_bgn=0, uop_end=1, iter_out=1, iter_in=1, alu_opcode=isa.ALU_SHR,
                    use_imm=True, imm=-3)
    w0 = 4 | (1 << 6) | (1 << 21) | (1 << 35) | (1 << 49)
    w1 = (3 << 44) | (1 << 47) | ((-3 & 0xFFFF) << 48)
    assert isa.encode(a) == w0.to_bytes(8, "little") + w1.to_bytes(8, "little")
    assert isa.decode(isa.encode(a)).imm == -3


def test_module_assignment():
    assert isa.module_of(isa.MemInsn(memory_type=isa.MEM_INP)) == "load"
    assert isa.module_of(isa.MemInsn(memory_type=isa.MEM_WGT)) == "load"
    assert isa.module_of(isa.MemInsn(memory_type=isa.MEM_UOP)) == "compute"
    assert isa.module_of(isa.MemInsn(memory_type=isa.MEM_ACC_8BIT)) == "compute"
    assert isa.module_of(isa.MemInsn(opcode=isa.OP_STORE, memory_type=isa.MEM_OUT)) == "store"
    assert isa.module_of(isa.FinishInsn()) == "compute"


def test_vta_target_preset_is_the_default_configuration():
    from pathlib import Path

    preset = Path(__file__).resolve().parents[1] / "targets" / "vta.json"
    assert load_config(preset) == DEFAULT
