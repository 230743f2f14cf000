"""The tactic library's calling contract (compile/tactics/abi.py): the C++ reads the same field
orders as the Python records, every record round-trips through its ``R.shape``, malformed
attrs are refused, and no pass indexes the contract by position. Runs without oneDNN."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from tvm import relax

from tvm_layerfuse.compile.tactics import abi, onednn

ROOT = Path(__file__).resolve().parents[1]


def test_cpp_constants_follow_the_python_field_order():
    source = onednn.SOURCE.read_text()
    assert abi.check_record_order(source) == []
    # the check itself notices a swap (two fields, two activations)
    assert abi.check_record_order(source.replace("kAlphaBits, kBetaBits", "kBetaBits, kAlphaBits"))
    assert abi.check_record_order(source.replace("kHardswish, kHardsigmoid", "kHardsigmoid, kHardswish"))
    # the block widths are fields of the records too (conv, pool, to_blocked)
    assert abi.check_record_order(source.replace("kSrcBlock, kDstBlock", "kDstBlock, kSrcBlock"))
    assert abi.check_record_order(source.replace("kPoolPadRight,\n  kPoolBlock", "kPoolBlock,\n  kPoolPadRight"))
    assert abi.check_record_order(source.replace("enum ToBlockedField : int { kBlock,", "enum ToBlockedField : int { kWidth,"))
    assert abi.check_record_order(source.replace("enum ScaleField : int { kScaleBlock,", "enum ScaleField : int { kScaleWidth,"))
    assert re.search(rf"constexpr int64_t kAbiVersion = {abi.ABI_VERSION};", source), "the C++ ABI version is abi.ABI_VERSION"


@pytest.mark.parametrize(
    "record",
    [
        abi.ConvAttrs.make(strides=(2, 1), padding=(1, 2, 3, 4), dilation=(1, 2), groups=4, act="clip", alpha=-1.5, beta=6.0),
        abi.ConvAttrs().replace(src_block=8, dst_block=abi.dst_block([16, 0, 8])),
        abi.PoolAttrs(abi.POOL_ALGORITHMS["avg"], 3, 3, 2, 2, 1, 1, 1, 1, 8),
        abi.ToBlockedAttrs(16),
        abi.ScaleAttrs(8),
        abi.ConcatSpec(16, (abi.Member(abi.CONV, 0, 4), abi.Member(abi.COPY, 16, 1), abi.Member(abi.CONV_PRE, 48, 7))),
    ],
    ids=["conv", "conv-blocked", "pool", "to_blocked", "scale", "concat"],
)
def test_records_round_trip_through_their_shape(record):
    shape = record.to_shape()
    assert isinstance(shape, relax.ShapeExpr)
    assert type(record).from_shape(shape) == record
    assert type(record).from_shape(record.values()) == record


def test_conv_attrs_carry_floats_as_bits():
    a = abi.ConvAttrs.make(strides=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1), groups=1, act="relu", alpha=0.1)
    assert a.act == abi.ACTIVATIONS["relu"] and abs(a.alpha - 0.1) < 1e-7 and a.beta == 0.0
    assert a.values()[abi.ConvAttrs.names().index("alpha_bits")] == abi.float_bits(0.1)


@pytest.mark.parametrize("field", ["stride_h", "stride_w", "groups", "dilation_h"])
def test_malformed_conv_attrs_are_refused(field):
    values = abi.ConvAttrs().values()
    values[abi.ConvAttrs.names().index(field)] = 0
    with pytest.raises(abi.AbiError, match=">= 1"):
        abi.ConvAttrs.from_shape(values)
    with pytest.raises(abi.AbiError, match=f"{len(abi.ConvAttrs.names())} fields"):
        abi.ConvAttrs.from_shape(values[:-1])


def test_block_widths_are_named_fields():
    a = abi.ConvAttrs().replace(src_block=8, dst_block=abi.dst_block([16, 0, 8]))
    assert [a.dst_block_of(j) for j in range(4)] == [16, 0, 8, 0]
    assert a.values()[abi.ConvAttrs.names().index("dst_block")] == 16 | 8 << (2 * abi.DST_BLOCK_BITS)
    assert abi.PoolAttrs.names()[-1] == "block" and abi.ToBlockedAttrs.names() == ("block",)
    x = relax.Var("x", relax.TensorType([1, 16, 4, 4], "float32"))
    call = abi.make(abi.TO_BLOCKED, input=x, attrs=abi.ToBlockedAttrs(8))
    again = abi.bind(abi.TO_BLOCKED, call.flat())
    assert again.args.input is x and again.attrs == abi.ToBlockedAttrs(8)
    assert [abi.layout_name(w) for w in abi.BLOCK_WIDTHS] == ["nchw", "nChw8c", "nChw16c"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: abi.ConvAttrs().replace(src_block=1).check(),  # the old 0/1 flag
        lambda: abi.ConvAttrs().replace(dst_block=abi.dst_block([16, 4])).check(),
        lambda: abi.PoolAttrs.from_shape([0, 2, 2, 2, 2, 0, 0, 0, 0, 32]),
        lambda: abi.ToBlockedAttrs.from_shape([0]),
        lambda: abi.ScaleAttrs.from_shape([4]),
        lambda: abi.ConcatSpec.from_shape([1, abi.COPY, 0, 1]),
    ],
    ids=["conv-src", "conv-dst", "pool", "to_blocked", "scale", "concat"],
)
def test_unknown_block_widths_are_refused(make):
    with pytest.raises(abi.AbiError, match="block"):
        make()


def test_registry_binds_arguments_by_role():
    x1, x2, s, t, w, b = (relax.Var(n, relax.TensorType([1, 16, 4, 4], "float32")) for n in ("x1", "x2", "s", "t", "w", "b"))
    attrs = abi.ConvAttrs()
    bound = abi.bind(abi.CONV2D_PRE, [x1, x2, s, t, w, b, attrs.to_shape()])
    assert bound.args.inputs == (x1, x2) and bound.args.scale is s and bound.args.weight is w and bound.attrs == attrs
    assert bound.flat()[:6] == [x1, x2, s, t, w, b]
    r = relax.Var("r", relax.TensorType([1, 16, 4, 4], "float32"))
    add = abi.make(abi.CONV2D_ADD, input=x1, weight=w, bias=b, residual=r, attrs=attrs)
    assert add.flat()[:4] == [x1, w, b, r]
    with pytest.raises(abi.AbiError, match="takes"):
        abi.bind(abi.CONV2D_ADD, [x1, w, b, attrs.to_shape()])
    # concat_convs: each member says how many arguments it takes; copies count as copied bytes
    block = abi.concat_convs(0, [(0, add), (16, abi.copy_member(x2)), (32, bound)])
    again = abi.bind(abi.CONCAT_CONVS, block.flat())
    assert [m.nargs for m, _ in again.args.members] == [5, 1, 7]
    assert again.args.members[2][1].args.inputs == (x1, x2)
    call = block.expr(relax.TensorType([1, 48, 4, 4], "float32"))
    writes = abi.library_writes(call)
    piece = 16 * 4 * 4 * 4
    assert writes == abi.LibraryWrites(computed=2 * piece, copied=piece, scratch=2 * piece)


def test_no_positional_use_of_the_contract_outside_abi():
    found = subprocess.run(
        ["grep", "-rnE", r"attrs\[[0-9]+\]|args\[[0-9]+\]", "tvm_layerfuse/compile/tactics", "tvm_layerfuse/lowering",
         "--include=*.py"],
        cwd=ROOT, capture_output=True, text=True,
    ).stdout.splitlines()
    assert [line for line in found if not line.startswith("tvm_layerfuse/compile/tactics/abi.py")] == []
