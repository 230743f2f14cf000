"""The oneDNN tactic's data-movement rewrites, before and after, in TVMScript: split pieces as
outputs, the layout of each tensor between library calls, convs writing into a concat block,
a residual conv writing into its residual, and the whole pass on an imported model - with
the library's answers (kernel names, timings) given by an oracle, so that all of this runs
where oneDNN is not installed (the library is never loaded)."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from graphs import Net
from tvm_layerfuse.compile.tactics import abi, onednn
from tvm_layerfuse.compile.tactics.onednn_inplace import INPLACE_WRAPPER, concats_in_place, residuals_in_place
from tvm_layerfuse.compile.tactics.onednn_layout import assign_layouts, merge_splits
from tvm_layerfuse.compile.tactics.oracle import use_oracle
from tvm_layerfuse.compile.tactics.use_onednn import NO_WINOGRAD, UseOneDNNConv

# ConvAttrs of a 1x1 / 3x3 conv with relu: (strides, pads t l b r, dilations, groups, act,
# src_block, dst_block, alpha, beta, algorithm, layer, packed, weight dims: plain weights here);
# the oracle's CPU has 16-channel blocks
assert abi.ConvAttrs.names()[10:12] == ("src_block", "dst_block") and len(abi.ConvAttrs.names()) == 21


class Oracle:
    """The library's answers without the library: an AVX-512 CPU (16-channel blocks), every
    layer gets an optimised kernel named after its layouts, and Winograd is never there."""

    def __init__(self) -> None:
        self.asked: list = []

    def block_width(self):
        return 16

    def conv_kernel(self, x_shape, w_shape, attrs, *, residual):
        self.asked.append(("conv", tuple(x_shape), tuple(w_shape), attrs))
        if attrs.algorithm == 1:
            return "unsupported: no Winograd here"
        return f"jit:oracle src{attrs.src_block} dst{attrs.dst_block}"

    def time_conv(self, x_shape, w_shape, a, b, *, residual):
        raise AssertionError("no timing: Winograd is unsupported")

    def pool_kernel(self, x_shape, y_shape, attrs):
        return "jit:oracle pool"

    def dense_kernel(self, n, k, m):
        return "jit:oracle gemm"


@pytest.fixture(autouse=True)
def no_library(monkeypatch):
    """The rewrites must never load (or build) the library here."""

    def refuse():
        raise AssertionError("the library was loaded")

    monkeypatch.setattr(onednn, "load", refuse)
    with use_oracle(Oracle()):
        yield


# --------------------------------------------------------------------------- split pieces
@I.ir_module
class SplitBefore:
    @R.function
    def main(x: R.Tensor((1, 16, 8, 8), "float32"), w: R.Tensor((48, 16, 1, 1), "float32"), b: R.Tensor((48,), "float32")):
        with R.dataflow():
            y = R.call_dps_packed(
                "layerfuse.onednn.conv2d",
                (x, w, b, R.shape([1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0])),
                R.Tensor((1, 48, 8, 8), "float32"),
            )
            s = R.split(y, indices_or_sections=[16, 32], axis=1)
            p0 = s[0]
            p1 = s[1]
            p2 = s[2]
            z = R.add(p0, p1)
            z2 = R.add(z, p2)
            R.output(z2)
        return z2


@I.ir_module
class SplitExpected:
    @R.function
    def main(x: R.Tensor((1, 16, 8, 8), "float32"), w: R.Tensor((48, 16, 1, 1), "float32"), b: R.Tensor((48,), "float32")):
        with R.dataflow():
            s = R.call_dps_packed(
                "layerfuse.onednn.conv2d",
                (x, w, b, R.shape([1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0])),
                [
                    R.Tensor((1, 16, 8, 8), "float32"),
                    R.Tensor((1, 16, 8, 8), "float32"),
                    R.Tensor((1, 16, 8, 8), "float32"),
                ],
            )
            p0 = s[0]
            p1 = s[1]
            p2 = s[2]
            z = R.add(p0, p1)
            z2 = R.add(z, p2)
            R.output(z2)
        return z2


def test_split_pieces_become_the_outputs_of_the_merged_conv():
    after = relax.transform.DeadCodeElimination()(tvm.IRModule({"main": merge_splits(SplitBefore["main"])}))
    tvm.ir.assert_structural_equal(after["main"], SplitExpected["main"])


# --------------------------------------------------------------------------- layouts
@I.ir_module
class ChainBefore:
    @R.function
    def main(
        x: R.Tensor((1, 16, 8, 8), "float32"),
        w1: R.Tensor((32, 16, 3, 3), "float32"),
        b1: R.Tensor((32,), "float32"),
        w2: R.Tensor((32, 32, 3, 3), "float32"),
        b2: R.Tensor((32,), "float32"),
    ):
        with R.dataflow():
            y = R.call_dps_packed(
                "layerfuse.onednn.conv2d",
                (x, w1, b1, R.shape([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])),
                R.Tensor((1, 32, 8, 8), "float32"),
            )
            z = R.call_dps_packed(
                "layerfuse.onednn.conv2d_add",
                (y, w2, b2, y, R.shape([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0])),
                R.Tensor((1, 32, 8, 8), "float32"),
            )
            R.output(z)
        return z


def test_a_residual_shares_its_layout_with_the_result_the_caller_reads():
    layers: list = []
    after = assign_layouts(ChainBefore["main"], layers)
    # y is z's residual: one layout class with z, which the caller reads -> plain all through
    tvm.ir.assert_structural_equal(after, ChainBefore["main"])


@I.ir_module
class ChainNoResidualBefore:
    @R.function
    def main(
        x: R.Tensor((1, 16, 8, 8), "float32"),
        w1: R.Tensor((32, 16, 3, 3), "float32"),
        b1: R.Tensor((32,), "float32"),
        w2: R.Tensor((32, 32, 3, 3), "float32"),
        b2: R.Tensor((32,), "float32"),
    ):
        with R.dataflow():
            y = R.call_dps_packed(
                "layerfuse.onednn.conv2d",
                (x, w1, b1, R.shape([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])),
                R.Tensor((1, 32, 8, 8), "float32"),
            )
            z = R.call_dps_packed(
                "layerfuse.onednn.conv2d",
                (y, w2, b2, R.shape([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0])),
                R.Tensor((1, 32, 8, 8), "float32"),
            )
            R.output(z)
        return z


@I.ir_module
class ChainNoResidualExpected:
    @R.function
    def main(
        x: R.Tensor((1, 16, 8, 8), "float32"),
        w1: R.Tensor((32, 16, 3, 3), "float32"),
        b1: R.Tensor((32,), "float32"),
        w2: R.Tensor((32, 32, 3, 3), "float32"),
        b2: R.Tensor((32,), "float32"),
    ):
        with R.dataflow():
            y = R.call_dps_packed(
                "layerfuse.onednn.conv2d",
                (x, w1, b1, R.shape([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0])),
                R.Tensor((1, 32, 8, 8), "float32"),
            )
            z = R.call_dps_packed(
                "layerfuse.onednn.conv2d",
                (y, w2, b2, R.shape([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 16, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0])),
                R.Tensor((1, 32, 8, 8), "float32"),
            )
            R.output(z)
        return z


def test_a_conv_to_conv_edge_is_blocked():
    layers = [
        onednn_choice := __import__("tvm_layerfuse.compile.tactics.choice", fromlist=["LayerChoice"]).LayerChoice(
            "c1", "onednn", id=0
        ),
        type(onednn_choice)("c2", "onednn", id=1),
    ]
    after = assign_layouts(ChainNoResidualBefore["main"], layers)
    tvm.ir.assert_structural_equal(after, ChainNoResidualExpected["main"])
    # the report is keyed by the layer id each call carries
    assert [c.layout for c in layers] == ["nchw>nChw16c", "nChw16c>nchw"]
    assert layers[1].kernel == "jit:oracle src16 dst0"


# --------------------------------------------------------------------------- concat in place
@I.ir_module
class ConcatBefore:
    @R.function
    def main(
        x: R.Tensor((1, 16, 8, 8), "float32"),
        u: R.Tensor((1, 16, 8, 8), "float32"),
        w1: R.Tensor((32, 16, 1, 1), "float32"),
        b1: R.Tensor((32,), "float32"),
        w2: R.Tensor((16, 16, 1, 1), "float32"),
        b2: R.Tensor((16,), "float32"),
    ):
        with R.dataflow():
            y1 = R.call_dps_packed(
                "layerfuse.onednn.conv2d",
                (x, w1, b1, R.shape([1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])),
                R.Tensor((1, 32, 8, 8), "float32"),
            )
            y2 = R.call_dps_packed(
                "layerfuse.onednn.conv2d",
                (x, w2, b2, R.shape([1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0])),
                R.Tensor((1, 16, 8, 8), "float32"),
            )
            c = R.call_dps_packed("layerfuse.onednn.concat", (y1, u, y2), R.Tensor((1, 64, 8, 8), "float32"))
            R.output(c)
        return c


@I.ir_module
class ConcatExpected:
    """spec: (blocked 0; conv at channel 0 with 4 arguments, a copy at 32 with 1, conv at 48 with 4)."""

    @R.function
    def main(
        x: R.Tensor((1, 16, 8, 8), "float32"),
        u: R.Tensor((1, 16, 8, 8), "float32"),
        w1: R.Tensor((32, 16, 1, 1), "float32"),
        b1: R.Tensor((32,), "float32"),
        w2: R.Tensor((16, 16, 1, 1), "float32"),
        b2: R.Tensor((16,), "float32"),
    ):
        with R.dataflow():
            c = R.call_dps_packed(
                "layerfuse.onednn.concat_convs",
                (
                    R.shape([0, 1, 0, 4, 0, 32, 1, 1, 48, 4]),
                    x,
                    w1,
                    b1,
                    R.shape([1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
                    u,
                    x,
                    w2,
                    b2,
                    R.shape([1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0]),
                ),
                R.Tensor((1, 64, 8, 8), "float32"),
            )
            R.output(c)
        return c


def test_convs_write_their_channels_of_the_concat_block():
    layers: list = []
    after = relax.transform.DeadCodeElimination()(tvm.IRModule({"main": concats_in_place(ConcatBefore["main"], layers)}))
    tvm.ir.assert_structural_equal(after["main"], ConcatExpected["main"])
    call = after["main"].body.blocks[0].bindings[-1].value
    # a copy member's bytes count as copied, the conv members' as computed
    piece = 16 * 8 * 8 * 4
    assert abi.library_writes(call) == abi.LibraryWrites(computed=3 * piece, copied=piece, scratch=0)


# --------------------------------------------------------------------------- residual in place
@I.ir_module
class ResidualBefore:
    @R.function
    def main(
        x: R.Tensor((1, 16, 8, 8), "float32"),
        w1: R.Tensor((16, 16, 1, 1), "float32"),
        b1: R.Tensor((16,), "float32"),
        w2: R.Tensor((16, 16, 1, 1), "float32"),
        b2: R.Tensor((16,), "float32"),
    ):
        with R.dataflow():
            r = R.call_dps_packed(
                "layerfuse.onednn.conv2d",
                (x, w1, b1, R.shape([1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])),
                R.Tensor((1, 16, 8, 8), "float32"),
            )
            y = R.call_dps_packed(
                "layerfuse.onednn.conv2d_add",
                (x, w2, b2, r, R.shape([1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0])),
                R.Tensor((1, 16, 8, 8), "float32"),
            )
            R.output(y)
        return y


def test_a_residual_conv_writes_into_its_residual():
    choices: list = []
    after = residuals_in_place(ResidualBefore, choices)
    assert choices == [("y", "in-place")]
    (gv,) = [gv for gv in after.get_global_vars() if gv.name_hint.startswith(INPLACE_WRAPPER)]
    y = after["main"].body.blocks[0].bindings[-1].value
    assert y.op.name == "relax.call_tir_inplace" and [int(i) for i in y.attrs.inplace_indices] == [3]
    callee, args = y.args
    assert callee.same_as(gv)
    params = ResidualBefore["main"].params
    r = after["main"].body.blocks[0].bindings[0].var
    tvm.ir.assert_structural_equal(list(args.fields), [params[0], params[3], params[4], r], map_free_vars=True)
    # the wrapper passes the attrs on as integers, in the record's order
    text = after[gv].script()
    assert "layerfuse.onednn.conv2d_add_inplace" in text
    assert ", ".join(f"T.int64({v})" for v in [1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1]) in text


# --------------------------------------------------------------------------- the whole pass
def test_the_whole_pass_runs_on_an_imported_model_with_the_oracle():
    from tvm_layerfuse.relax.pipeline import fuse_with_report

    n = Net(seed=3)
    x = n.input("x", (1, 16, 8, 8))
    a = n.relu(n.conv(x, 32, name="c1"))
    b = n.relu(n.node("Add", [n.conv(a, 32, name="c2"), a]))
    y = n.concat([n.conv(b, 16, k=1, name="c3"), n.conv(b, 32, k=1, name="c4", pad=0)])
    model = n.build([n.conv(y, 16, k=1, name="c5")])
    oracle = Oracle()
    chooser = UseOneDNNConv(oracle=oracle, winograd="always")
    mod = chooser(fuse_with_report(model, bind=True).mod)
    convs = [c for c in chooser.layers if c.tactic == "onednn" and not c.layer.startswith(("pool:", "dense:", "concat:"))]
    # c3 and c4 read the same input: merged into one conv, whose two pieces the concat holds
    assert len(convs) == 4 and sorted(c.id for c in convs) == list(range(len(convs)))
    assert all(c.timing.startswith(NO_WINOGRAD) for c in convs if "3, 3]" in c.shape)
    calls = []
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(abi.parse_call(e)) if abi.parse_call(e) else None)
    # c1, c2 with its residual (it reads the residual as its input too: a copy), c3+c4 merged
    # (the concat of their split cancelled), c5
    assert sorted(b.call.key for b in calls) == ["conv2d", "conv2d", "conv2d", "conv2d_add"]
    assert [c.layout for c in sorted(convs, key=lambda c: c.id)] == [
        "nchw>nChw16c", "nChw16c>nChw16c", "nChw16c>nChw16c", "nChw16c>nchw"
    ]
    assert oracle.asked, "the rewrites asked the oracle, not the library"


# --------------------------------------------------------------------------- the layout check
@I.ir_module
class BlockedReadByTVM:
    @R.function
    def main(x: R.Tensor((1, 16, 8, 8), "float32"), w: R.Tensor((32, 16, 1, 1), "float32"), b: R.Tensor((32,), "float32")):
        with R.dataflow():
            y = R.call_dps_packed(
                "layerfuse.onednn.conv2d",
                (x, w, b, R.shape([1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0])),
                R.Tensor((1, 32, 8, 8), "float32"),
            )
            z = R.nn.relu(y)
            R.output(z)
        return z


def test_the_layout_check_finds_blocked_bytes_read_as_plain():
    from tvm_layerfuse.compile.tactics.verify_layouts import check_layouts, verify_layouts
    from tvm_layerfuse.errors import BuildError

    assert verify_layouts(ChainNoResidualExpected) == []
    assert verify_layouts(ConcatExpected) == []
    problems = verify_layouts(BlockedReadByTVM)
    assert problems == ["main: y is nChw16c, read by z (relax.nn.relu) as nchw"]
    # a conv reading blocked bytes with src_block 0 is found as well
    src_block = "1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 16, 0, 0, 0, 0, 1"
    wrong_flag = ChainNoResidualExpected.script().replace(src_block, "1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1")
    assert verify_layouts(tvm.script.from_source(wrong_flag)) == ["main: y is nChw16c, read by z (conv2d) as nchw"]
    # and one reading them as another block width
    wrong_width = ChainNoResidualExpected.script().replace(src_block, "1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 8, 0, 0, 0, 0, 1")
    assert verify_layouts(tvm.script.from_source(wrong_width)) == ["main: y is nChw16c, read by z (conv2d) as nChw8c"]
    with pytest.raises(BuildError, match="blocked tensors read as plain"):
        check_layouts(BlockedReadByTVM)
