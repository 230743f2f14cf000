"""In-place concat and split-output buffers (tvm_layerfuse.lowering).

Every model is compiled twice on this machine's CPU, with ``layerfuse_pipeline`` and with
TVM's default pipeline; both must match onnxruntime (graph optimisations off) within
``RTOL``; ours must leave no concat kernel for the concats it makes free, copy 0 bytes in
concat kernels and plan no more activation memory than the default. Refusals are checked
by their reason. Graphs are tiny (8x8 images, a few channels): seconds each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import tirx as T

from graphs import RTOL, Net, feeds_for, rel_err, run_ort
from tvm_layerfuse.errors import UsageError
from tvm_layerfuse.lowering import (
    _tir,
    concat_report,
    format_concat_report,
    layerfuse_pipeline,
    plan_check,
)
from tvm_layerfuse.relax.pipeline import default_target, fuse, run

TARGET = default_target()
H = W = 8
F32 = 4


# ----------------------------------------------------------------------------- helpers
@dataclass
class Built:
    model: Any
    ours: Any  # relax.VMExecutable, layerfuse_pipeline
    default: Any  # relax.VMExecutable, TVM's default pipeline
    pipe: Any  # the LayerfusePipeline pass (reports of the last run)
    report: dict
    default_report: dict

    def concat(self, status=None) -> list[dict]:
        return [c for c in self.pipe.inplace_report.concats if status is None or c["status"] == status]


def build_both(model, *, horizontal: bool = True, **options) -> Built:
    mod = fuse(model, horizontal=horizontal)
    pipe = layerfuse_pipeline(TARGET, **options)
    ours = tvm.compile(mod, target=TARGET, relax_pipeline=pipe)
    default = tvm.compile(mod, target=TARGET, relax_pipeline=relax.get_default_pipeline(TARGET))
    feeds = feeds_for(model, seed=1)
    expected = run_ort(model, feeds)
    for name, ex in (("layerfuse", ours), ("default", default)):
        got = run(ex, list(feeds.values()))
        assert len(got) == len(expected)
        for e, g in zip(expected, got):
            assert e.shape == g.shape
            err = rel_err(e, g)
            assert err <= RTOL, f"{name} pipeline differs from onnxruntime: relative error {err:.3g} > {RTOL}"
    return Built(model, ours, default, pipe, concat_report(ours), concat_report(default))


def assert_free(b: Built, *, in_place: int) -> None:
    """``in_place`` concats were made free and nothing is worse than TVM's default."""
    assert len(b.concat("in_place")) + len(b.concat("view")) == in_place, b.pipe.inplace_report.concats
    if not b.concat("fallback"):
        assert b.report["concat_kernels"] == 0, b.report
        assert b.report["concat_bytes_copied"] == 0, b.report
    assert b.report["concat_bytes_copied"] <= b.default_report["concat_bytes_copied"]
    assert b.report["activation_bytes"] <= b.default_report["activation_bytes"], format_concat_report(b.report, b.default_report)
    assert b.report["kernels"] <= b.default_report["kernels"] - in_place


def conv_relu(n: Net, x: str, cout: int, k: int = 1) -> str:
    return n.relu(n.conv(x, cout, k=k))


# ----------------------------------------------------------------------------- graphs
def inception_like(*, batch: int = 1, axis: int = 1, seed: int = 0) -> Any:
    """GoogLeNet block: three 1x1 convs on x (merged horizontally: one conv + split), two
    3x3 convs, a pool branch, Concat(axis). ``axis=2`` uses equal channel counts."""
    n = Net(seed=seed)
    x = n.input("x", (batch, 8, H, W))
    c = (4, 5, 3, 6) if axis == 1 else (4, 4, 4, 4)
    b1 = conv_relu(n, x, c[0])
    b2 = conv_relu(n, conv_relu(n, x, 3), c[1], k=3)
    b3 = conv_relu(n, conv_relu(n, x, 2), c[2], k=3)
    b4 = conv_relu(n, n.maxpool(x), c[3])
    y = n.concat([b1, b2, b3, b4], axis=axis)
    return n.build([conv_relu(n, y, 4)])


def fire_like(*, batch: int = 1) -> Any:
    """Two SqueezeNet fire modules: squeeze 1x1, expand 1x1 and 3x3, Concat."""
    n = Net(seed=2)
    x = n.input("x", (batch, 6, H, W))
    for _ in range(2):
        s = conv_relu(n, x, 4)
        x = n.concat([conv_relu(n, s, 8), conv_relu(n, s, 8, k=3)])
    return n.build([conv_relu(n, x, 4)])


def densenet_like(*, batch: int = 1, layers: int = 3) -> Any:
    """Caffe-style dense block: c_k = Concat(c_{k-1}, f(c_{k-1})), f = BN-ReLU-1x1-ReLU-3x3.

    The last concat is read by two layers, so FuseOps keeps every concat a kernel of its own."""
    n = Net(seed=3)
    x = n.input("x", (batch, 3, H, W))
    c = conv_relu(n, x, 8, k=3)
    for _ in range(layers):
        h = conv_relu(n, n.relu(n.bn(c)), 8)
        c = n.concat([c, n.conv(h, 4, k=3, bias=False)])
    head = conv_relu(n, n.relu(n.bn(c)), 4)
    side = conv_relu(n, c, 4)
    return n.build([n.node("Add", [head, side])])


# ----------------------------------------------------------------------------- in place
@pytest.mark.parametrize("batch", [1, 4])
def test_inception_like_channel_concat(batch):
    b = build_both(inception_like(batch=batch))
    assert_free(b, in_place=1)
    assert b.report["split_kernels"] == 0 and b.default_report["split_kernels"] == 1
    assert [s["parts"] for s in b.pipe.split_report.rewritten] == [[[batch, 4, H, W], [batch, 3, H, W], [batch, 2, H, W]]]
    (concat,) = b.concat("in_place")
    # byte_offset_i = o_i * H * W * itemsize: one contiguous run per producer at batch 1
    assert [i["range"] for i in concat["inputs"]] == [[0, 4], [4, 9], [9, 12], [12, 18]]
    assert [i["byte_offset"] for i in concat["inputs"]] == [o * H * W * F32 for o in (0, 4, 9, 12)]
    assert all(i["contiguous"] is (batch == 1) for i in concat["inputs"])  # strided writes at batch 4


@pytest.mark.parametrize("batch", [1, 4])
def test_concat_on_another_axis_is_written_with_strides(batch):
    b = build_both(inception_like(batch=batch, axis=2))
    assert_free(b, in_place=1)
    (concat,) = b.concat("in_place")
    assert concat["axis"] == 2
    assert [i["range"] for i in concat["inputs"]] == [[0, 8], [8, 16], [16, 24], [24, 32]]
    assert not any(i["contiguous"] for i in concat["inputs"])


def test_concat_on_the_batch_axis_is_contiguous():
    n = Net(seed=4)
    x = n.input("x", (1, 6, H, W))
    y = n.concat([conv_relu(n, x, 4), conv_relu(n, x, 4, k=3), conv_relu(n, n.maxpool(x), 4)], axis=0)
    b = build_both(n.build([conv_relu(n, y, 3)]))
    assert_free(b, in_place=1)
    (concat,) = b.concat("in_place")
    assert [i["byte_offset"] for i in concat["inputs"]] == [k * 4 * H * W * F32 for k in range(3)]
    assert all(i["contiguous"] for i in concat["inputs"])


def test_fire_modules():
    b = build_both(fire_like())
    assert_free(b, in_place=2)


@pytest.mark.parametrize("batch, layers", [(1, 3), (2, 2)])
def test_nested_concats_share_one_block(batch, layers):
    b = build_both(densenet_like(batch=batch, layers=layers))
    assert b.default_report["concat_kernels"] == layers
    assert_free(b, in_place=layers)
    roots = b.concat("in_place")
    views = b.concat("view")
    assert len(roots) == 1 and len(views) == layers - 1
    assert {c["block"] for c in roots + views} == {roots[0]["concat"]}
    # each earlier concat is a prefix view of the next: [0, C_k) of the outer block
    for c in views:
        assert c["inputs"][0]["range"][0] == 0
        assert c["inputs"][0]["offsets"] == [0, 0, 0, 0]
    assert b.report["concat_bytes_copied"] == 0 and b.default_report["concat_bytes_copied"] > 0


def test_nesting_disabled_keeps_inner_concats_as_copies_into_the_outer_block():
    """c3 takes a block; c2 (its input) stays a kernel writing into c3's block; c1, an input
    of a kernel that is not in place, gets a block of its own."""
    b = build_both(densenet_like(), nested=False)
    (fallback,) = b.concat("fallback")
    assert "nesting disabled" in fallback["reason"]
    assert_free(b, in_place=2)
    assert 0 < b.report["concat_bytes_copied"] < b.default_report["concat_bytes_copied"]


def test_fused_concat_tree_is_flattened():
    """Inception-v3 block E: Concat(x, Concat(a, b), Concat(c, d), p); FuseOps fuses the
    inner concats into the outer kernel, which is recognised as one six-input concat."""
    n = Net(seed=5)
    x = n.input("x", (1, 6, H, W))
    t1, t2 = conv_relu(n, x, 3), conv_relu(n, x, 3, k=3)
    y = n.concat([conv_relu(n, x, 4), n.concat([conv_relu(n, t1, 2), conv_relu(n, t1, 3, k=3)]),
                  n.concat([conv_relu(n, t2, 2), conv_relu(n, t2, 3, k=3)]), conv_relu(n, n.maxpool(x), 2)])  # fmt: skip
    b = build_both(n.build([conv_relu(n, y, 4)]), horizontal=False)
    assert_free(b, in_place=1)
    (concat,) = b.concat("in_place")
    # the fused kernel's parameters come in FuseTIR's order; the slots tile [0, 16)
    assert sorted(i["range"] for i in concat["inputs"]) == [[0, 4], [4, 6], [6, 9], [9, 11], [11, 14], [14, 16]]


def test_split_piece_lands_at_a_nonzero_offset():
    """The merged 1x1 conv's concat-bound piece is the last concat input."""
    n = Net(seed=6)
    x = n.input("x", (1, 6, H, W))
    a, r = conv_relu(n, x, 4), conv_relu(n, x, 3)  # merged: one conv + split
    y = n.concat([conv_relu(n, r, 5, k=3), conv_relu(n, n.maxpool(x), 2), a])
    b = build_both(n.build([conv_relu(n, y, 4)]))
    assert_free(b, in_place=1)
    assert b.report["split_kernels"] == 0
    (concat,) = b.concat("in_place")
    last = next(i for i in concat["inputs"] if i["range"] == [7, 11])
    assert last["producer"].endswith("_split") and last["byte_offset"] == 7 * H * W * F32


def test_split_of_a_conv_without_epilogue():
    """Merged bias-free convs with no activation: the conv's reduction block writes the
    output itself (init + update); each copy of it reduces over its own channel range."""
    n = Net(seed=12)
    x = n.input("x", (1, 6, H, W))
    a, r = n.conv(x, 4, k=1, bias=False), n.conv(x, 3, k=1, bias=False)
    y = n.concat([a, conv_relu(n, r, 5, k=3)])
    b = build_both(n.build([conv_relu(n, y, 4)]))
    assert_free(b, in_place=1)
    assert len(b.pipe.split_report.rewritten) == 1 and b.report["split_kernels"] == 0


def test_split_fused_into_concat_stays_a_copy():
    """All pieces of a split feed one concat, out of order: FuseOps fuses split and concat
    into one copy kernel, which is not a plain concat: it stays (counted as a copy)."""
    n = Net(seed=6)
    x = n.input("x", (1, 6, H, W))
    a, c = conv_relu(n, x, 4), conv_relu(n, x, 3)  # merged: one conv + split
    b = build_both(n.build([conv_relu(n, n.concat([c, conv_relu(n, x, 5, k=3), a]), 4)]))
    assert not b.pipe.inplace_report.concats  # not recognised as a concat kernel
    assert b.report["concat_kernels"] == b.default_report["concat_kernels"] == 1
    assert b.report["concat_bytes_copied"] == b.default_report["concat_bytes_copied"] == 12 * H * W * F32


def test_producer_also_read_by_another_layer():
    n = Net(seed=7)
    x = n.input("x", (2, 6, H, W))
    a, c = conv_relu(n, x, 4, k=3), conv_relu(n, n.maxpool(x), 5)
    y = n.concat([a, c])
    b = build_both(n.build([conv_relu(n, y, 3), conv_relu(n, a, 2)]))  # `a` is read by the concat and a conv
    assert_free(b, in_place=1)


# ----------------------------------------------------------------------------- fallbacks
def _one_fallback(b: Built, words: str) -> dict:
    (concat,) = b.concat("fallback")
    assert words in concat["reason"], concat["reason"]
    assert b.report["concat_kernels"] == 1
    assert b.report["concat_bytes_copied"] == b.default_report["concat_bytes_copied"] > 0
    return concat


def test_graph_input_producer_falls_back():
    n = Net(seed=8)
    x = n.input("x", (1, 6, H, W))
    b = build_both(n.build([conv_relu(n, n.concat([conv_relu(n, x, 4), x]), 3)]))
    _one_fallback(b, "graph input")


def test_graph_output_producer_falls_back():
    n = Net(seed=9)
    x = n.input("x", (1, 6, H, W))
    a = conv_relu(n, x, 4)
    b = build_both(n.build([conv_relu(n, n.concat([a, conv_relu(n, x, 3, k=3)]), 3), a]))
    _one_fallback(b, "not only as a kernel argument")


def test_duplicate_input_falls_back():
    n = Net(seed=10)
    x = n.input("x", (1, 6, H, W))
    a = conv_relu(n, x, 4)
    b = build_both(n.build([conv_relu(n, n.concat([a, a]), 3)]))
    _one_fallback(b, "appears twice")


def test_constant_input_falls_back():
    n = Net(seed=11)
    x = n.input("x", (1, 6, H, W))
    k = n.const(np.random.default_rng(0).standard_normal((1, 2, H, W)).astype(np.float32))
    b = build_both(n.build([conv_relu(n, n.concat([conv_relu(n, x, 4), k]), 3)]))
    _one_fallback(b, "constant")


# ----------------------------------------------------------------------------- pipeline
def test_pipeline_places_the_passes_after_fuse_tir():
    names = [p.info.name for p in layerfuse_pipeline(TARGET).passes()]
    k = names.index("FuseTIR")
    assert names[k + 1 : k + 3] == ["SplitOutputBuffers", "InPlaceConcat"]
    assert names.index("StaticPlanBlockMemory") > k + 2
    default = [p.info.name for p in layerfuse_pipeline(TARGET, split_outputs=False, inplace_concat=False).passes()]
    assert default == [n for n in names if n not in ("SplitOutputBuffers", "InPlaceConcat")]


def test_module_report_agrees_with_executable_report():
    model = inception_like()
    mod = fuse(model)
    for layerfuse in (True, False):
        planned = concat_report(mod, target=TARGET, layerfuse=layerfuse)
        pipe = layerfuse_pipeline(TARGET) if layerfuse else relax.get_default_pipeline(TARGET)
        built = concat_report(tvm.compile(mod, target=TARGET, relax_pipeline=pipe))
        for key in ("kernels", "concat_kernels", "concat_bytes_copied", "split_kernels", "activation_bytes"):
            assert planned[key] == built[key], (key, planned, built)
    line = format_concat_report(concat_report(mod, target=TARGET), concat_report(mod, target=TARGET, layerfuse=False))
    assert line.startswith("bytes copied by concat: 0;") and "vs TVM default" in line


def test_plan_check_counts():
    from tvm_layerfuse.planner import plan

    model = fire_like()
    b = build_both(model)
    check = plan_check(plan(model), b.pipe.inplace_report)
    assert check == {"plan_in_place": 2, "lowering_in_place": 2, "lowering_fallback": 0}


def test_cuda_build_keeps_dlight_and_makes_concat_free():
    tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    mod = fuse(densenet_like())
    pipe = layerfuse_pipeline(tgt)
    from tvm_layerfuse.compile.cuda import nvcc_fatbin

    with nvcc_fatbin("sm_90"), tgt:  # device code through nvcc, whatever other tests loaded before
        ex = tvm.compile(mod, target=tgt, relax_pipeline=pipe)
    kinds = []

    def walk(m):
        kinds.append(m.kind)
        for sub in m.imports:
            walk(sub)

    walk(ex.mod)
    assert "cuda" in kinds  # device code was generated: the dlight schedules ran on the new kernels
    report = concat_report(ex)
    assert report["concat_kernels"] == 0 and report["concat_bytes_copied"] == 0
    assert any("split kernels kept on GPU" in note for note in pipe.notes)
    with pytest.raises(UsageError, match="dlight"):
        layerfuse_pipeline(tgt, split_outputs=True)


def test_zoo_models_lose_every_plain_concat():
    zoo = pytest.importorskip("tvm_layerfuse.testing.zoo")
    for model in (zoo.squeezenet1_1(image=32, width=0.125), zoo.densenet121(image=32, width=0.125, concat="nested", block_config=(2, 3))):
        b = build_both(model)
        assert b.default_report["concat_kernels"] > 0
        assert b.report["concat_kernels"] == 0 and b.report["concat_bytes_copied"] == 0
        assert b.report["activation_bytes"] <= b.default_report["activation_bytes"]
        assert not b.concat("fallback")


# ----------------------------------------------------------------------------- TIR level
@T.prim_func(private=True, s_tir=True)
def _add_one(
    A: T.Buffer((T.int64(2), T.int64(2), T.int64(4)), "float32"),
    B: T.Buffer((T.int64(2), T.int64(2), T.int64(4)), "float32"),
):
    T.func_attr({"tirx.noalias": True})
    for i0, i1, i2 in T.grid(T.int64(2), T.int64(2), T.int64(4)):
        with T.sblock("add"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(A[v0, v1, v2])
            T.writes(B[v0, v1, v2])
            B[v0, v1, v2] = A[v0, v1, v2] + T.float32(1.0)


@T.prim_func(private=True, s_tir=True)
def _add_one_into_block(
    A: T.Buffer((T.int64(2), T.int64(2), T.int64(4)), "float32"),
    block: T.Buffer((T.int64(2), T.int64(5), T.int64(4)), "float32"),
):
    T.func_attr({"tirx.noalias": True})
    for i0, i1, i2 in T.grid(T.int64(2), T.int64(2), T.int64(4)):
        with T.sblock("add"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(A[v0, v1, v2])
            T.writes(block[v0, v1 + T.int64(3), v2])
            block[v0, v1 + T.int64(3), v2] = A[v0, v1, v2] + T.float32(1.0)


@T.prim_func(private=True, s_tir=True)
def _concat(
    A: T.Buffer((T.int64(1), T.int64(2), T.int64(4)), "float32"),
    B: T.Buffer((T.int64(1), T.int64(3), T.int64(4)), "float32"),
    C: T.Buffer((T.int64(1), T.int64(5), T.int64(4)), "float32"),
):
    for i0, i1, i2 in T.grid(T.int64(1), T.int64(5), T.int64(4)):
        with T.sblock("T_concat"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(B[v0, v1 - T.int64(2), v2], A[v0, v1, v2])
            T.writes(C[v0, v1, v2])
            C[v0, v1, v2] = T.if_then_else(T.int64(2) <= v1, B[v0, v1 - T.int64(2), v2], A[v0, v1, v2])


@T.prim_func(private=True, s_tir=True)
def _not_a_concat(
    A: T.Buffer((T.int64(1), T.int64(2), T.int64(4)), "float32"),
    B: T.Buffer((T.int64(1), T.int64(3), T.int64(4)), "float32"),
    C: T.Buffer((T.int64(1), T.int64(5), T.int64(4)), "float32"),
):
    for i0, i1, i2 in T.grid(T.int64(1), T.int64(5), T.int64(4)):
        with T.sblock("T_concat"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(B[v0, v1 - T.int64(1), v2], A[v0, v1, v2])
            T.writes(C[v0, v1, v2])
            C[v0, v1, v2] = T.if_then_else(T.int64(2) <= v1, B[v0, v1 - T.int64(1), v2], A[v0, v1, v2])


def test_retarget_moves_stores_into_the_block_region():
    a, b = _add_one.params
    block = _add_one_into_block.params[1]
    got = _tir.retarget(_add_one, {b: _tir.Region(block, (0, 3, 0))}, [a, block])
    tvm.ir.assert_structural_equal(got, _add_one_into_block)


def test_concat_recogniser_checks_the_offsets():
    kernel = _tir.match_concat(_concat)
    assert kernel.axis == 1 and kernel.offsets == (0, 2) and kernel.out_shape == (1, 5, 4)
    reason = _tir.match_concat(_not_a_concat)
    assert isinstance(reason, str) and "does not match its condition" in reason
    assert isinstance(_tir.match_concat(_add_one), str)
