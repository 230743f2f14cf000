"""The VTA host steps compiled by TVM (``host.so``) against their numpy interpretation.

One library holds a host op for every kind of host step and every ONNX op the numpy steps
know (stem conv with its epilogue and split outputs, grouped/dilated convs, LeakyRelu,
SiLU, LRN, pools with ceil mode and padding, the classifier, softmax ...). Each compiled
function runs through the runtime's :class:`HostSteps` (TVM's runtime VM) and must equal
:func:`tvm_layerfuse.runtime.vta.host.run_steps` to float64 rounding, and exactly where the inputs
are dequantized int8 values (max pools, global average of a power-of-two grid).
"""

from __future__ import annotations

import numpy as np
import pytest

from tvm_layerfuse.compile.presets import resolve
from tvm_layerfuse.compile.vta.host_library import build_host_library, host_onnx
from tvm_layerfuse.errors import ArtifactError
from tvm_layerfuse.runtime.vta import host
from tvm_layerfuse.runtime.vta.runtime import HostSteps

RNG = np.random.default_rng(7)
X = (1, 4, 9, 9)


def _f32(v):
    """A float attribute as an ONNX model holds it (float32) and the topology graph reads it."""
    return float(np.float32(v))


def _layer(op_type, ins, out, **attrs):
    return {"op": "layer", "op_type": op_type, "attrs": attrs, "in": ins, "out": out}


CONSTS = {
    "stem::W": RNG.standard_normal((8, 4, 3, 3)),
    "stem::b": RNG.standard_normal(8),
    "gw": RNG.standard_normal((8, 2, 3, 3)),
    "bn_g": RNG.random(4) + 0.5, "bn_b": RNG.standard_normal(4), "bn_m": RNG.standard_normal(4), "bn_v": RNG.random(4) + 0.1,
    "lo": np.array(-0.5), "hi": np.array(0.75),
    "scale": RNG.standard_normal((1, 4, 1, 1)),
    "fc_w": RNG.standard_normal((10, 36)), "fc_b": RNG.standard_normal(10),
    "shape": np.array([1, -1], np.int64),
}  # fmt: skip
SHAPES = {
    "x": X, "r": (1, 8, 5, 5), "y0": (1, 3, 5, 5), "y1": (1, 5, 5, 5),
    "g": (1, 8, 5, 5), "bn": X, "act": X, "silu": X, "lrn": X, "sum": X, "clip": X, "div": X,
    "mp": (1, 4, 4, 4), "ap": X, "gap": (1, 4, 1, 1), "gmp": (1, 4, 1, 1), "cat": (1, 8, 1, 1),
    "q": (1, 4, 6, 6), "qmax": (1, 4, 3, 3), "flat": (1, 36), "fc": (1, 10), "prob": (1, 10), "mm": (1, 10), "rs": (1, 36),
}  # fmt: skip
OPS = [
    {"name": "stem", "reads": ["x", "r"], "writes": ["y0", "y1"], "steps": [  # a refused fused conv: conv, residual, acts, split
        {"op": "conv", "in": "x", "w": "stem::W", "b": "stem::b", "strides": [2, 2], "pads": [1, 1, 1, 1], "out": "stem::y"},
        {"op": "add", "in": ["stem::y", "r"], "out": "stem::y"},
        {"op": "acts", "in": "stem::y", "acts": [{"kind": "relu"}, {"kind": "clip", "lo": None, "hi": 2.5}], "out": "stem::y"},
        {"op": "slice", "in": "stem::y", "c0": 0, "c1": 3, "out": "y0"},
        {"op": "slice", "in": "stem::y", "c0": 3, "c1": 8, "out": "y1"}]},
    {"name": "grouped", "reads": ["x"], "writes": ["g"], "steps": [
        _layer("Conv", ["x", {"const": "gw"}], "g", group=2, dilations=[2, 2], strides=[1, 1], pads=[0, 0, 0, 0])]},
    {"name": "bn_leaky", "reads": ["x"], "writes": ["act"], "steps": [
        _layer("BatchNormalization", ["x"] + [{"const": k} for k in ("bn_g", "bn_b", "bn_m", "bn_v")], "bn", epsilon=_f32(1e-3)),
        _layer("LeakyRelu", ["bn"], "act", alpha=_f32(0.1))]},
    {"name": "silu", "reads": ["x"], "writes": ["silu"], "steps": [
        _layer("Sigmoid", ["x"], "sig"), _layer("Mul", ["x", "sig"], "silu")]},
    {"name": "lrn", "reads": ["x"], "writes": ["lrn"], "steps": [
        _layer("LRN", ["x"], "lrn", size=3, alpha=_f32(1e-2), beta=0.75, bias=_f32(1.3))]},
    {"name": "sum_clip_div", "reads": ["x", "act", "silu"], "writes": ["sum", "clip", "div"], "steps": [
        _layer("Sum", ["x", "act", "silu"], "sum"),
        _layer("Clip", ["sum", {"const": "lo"}, {"const": "hi"}], "clip"),
        _layer("Sub", ["clip", {"const": "scale"}], "sub"), _layer("Div", ["sub", {"const": "scale"}], "div")]},
    {"name": "maxpool", "reads": ["x"], "writes": ["mp"], "steps": [
        _layer("MaxPool", ["x"], "mp", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)]},
    {"name": "avgpool", "reads": ["x"], "writes": ["ap"], "steps": [
        _layer("AveragePool", ["x"], "ap", kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], count_include_pad=0)]},
    {"name": "global", "reads": ["x"], "writes": ["gap", "gmp", "cat"], "steps": [
        _layer("GlobalAveragePool", ["x"], "gap"), _layer("GlobalMaxPool", ["x"], "gmp"),
        {"op": "concat", "in": ["gap", "gmp"], "out": "cat"}]},
    {"name": "int8_pools", "reads": ["q"], "writes": ["qmax", "flat"], "steps": [
        _layer("MaxPool", ["q"], "qmax", kernel_shape=[2, 2], strides=[2, 2]), _layer("Flatten", ["qmax"], "flat0", axis=1),
        _layer("Identity", ["flat0"], "flat1"), _layer("Dropout", ["flat1"], "flat")]},
    {"name": "classifier", "reads": ["flat"], "writes": ["fc", "prob", "mm", "rs"], "steps": [
        _layer("Gemm", ["flat", {"const": "fc_w"}, {"const": "fc_b"}], "fc", transB=1, alpha=0.5, beta=2.0),
        _layer("Softmax", ["fc"], "prob", axis=1),
        _layer("MatMul", ["flat", {"const": "fc_w"}], "mm0") | {"in": ["flat", {"const": "fc_wt"}]},
        _layer("Identity", ["mm0"], "mm"),
        _layer("Reshape", ["flat", {"const": "shape"}], "rs")]},
]  # fmt: skip
CONSTS["fc_wt"] = np.ascontiguousarray(CONSTS["fc_w"].T)
for _op in OPS:
    _op["kind"] = "host"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("host_lib")
    lib = build_host_library(OPS, CONSTS, shapes=SHAPES, opset=13, spec=resolve("vta"), machine="x86_64", out_dir=out, file="host.so")
    by_op = {f.op: f for f in lib.functions}
    ops = [{**op, "function": by_op[op["name"]].function, "params": list(by_op[op["name"]].params)} for op in OPS]
    return HostSteps(lib.path, CONSTS, ops, machine="x86_64"), ops, CONSTS, lib


def _inputs(op, seed):
    rng = np.random.default_rng(seed)
    values = {}
    for n in op["reads"]:
        if n == "q":  # dequantized int8 activations (scale 2**-4): what VTA hands the host
            values[n] = rng.integers(-128, 128, SHAPES[n]).astype(np.float64) * 2.0**-4
        else:
            values[n] = rng.standard_normal(SHAPES[n])
    return values


def test_every_compiled_host_op_equals_the_numpy_steps(compiled):
    steps, ops, consts, lib = compiled
    assert [f.function for f in lib.functions] == [f"host_{k}" for k in range(len(OPS))]
    assert dict(zip([f.op for f in lib.functions], [f.params for f in lib.functions]))["stem"] == ("stem::W", "stem::b")
    for op in ops:
        for seed in (1, 2):
            values = _inputs(op, seed)
            want = dict(values)
            host.run_steps(op["steps"], want, consts)
            got = steps(op, values)
            assert sorted(got) == sorted(op["writes"])
            for name in op["writes"]:
                assert got[name].shape == want[name].shape, (op["name"], name)
                np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12 * np.abs(want[name]).max(), err_msg=op["name"])
        a, b = (steps(op, _inputs(op, s)) for s in (1, 2))  # live: inputs matter
        assert any(not np.array_equal(a[n], b[n]) for n in op["writes"]), op["name"]


def test_host_ops_on_dequantized_int8_are_exact(compiled):
    steps, ops, consts, _ = compiled
    op = next(o for o in ops if o["name"] == "int8_pools")
    values = _inputs(op, 3)
    want = dict(values)
    host.run_steps(op["steps"], want, consts)
    got = steps(op, values)
    np.testing.assert_array_equal(got["qmax"], want["qmax"])
    np.testing.assert_array_equal(got["flat"], want["flat"])


def test_lrn_is_written_in_float64_ops():
    """TVM's LRN converter multiplies by float32 constants; the host model spells it out."""
    model, weights = host_onnx(OPS[4]["steps"], CONSTS, reads=["x"], writes=["lrn"], shapes=SHAPES, opset=13)
    kinds = [n.op_type for n in model.graph.node]
    assert "LRN" not in kinds and "Pow" in kinds and weights == {}


def test_a_library_that_does_not_load_is_one_line(tmp_path):
    bad = tmp_path / "host.so"
    bad.write_bytes(b"\x7fELF not really")
    with pytest.raises(ArtifactError, match=r"^host library .*host.so' cannot be loaded \(.*\); expected a library built for aarch64"):
        HostSteps(bad, {}, [], machine="aarch64")
