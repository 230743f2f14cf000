"""VTA's int8 conv against a definition written here from scratch, not from the compiler's own
integer parameters: ``y_q = clamp(round_half_up(acc / 2**s), -128, 127)`` with
``acc = sum x_q * w_q + round_half_up(b * 2**F)``, ``F = f_x + f_w[c]``, ``s = F - f_out``.
Only the power-of-two scales (``f_x``, ``f_w``, ``f_out``) are taken from the build, and
checked against their definition (the largest ``f`` with ``max|t| * 2**f <= 127``).

The simulator (the programs VTA runs) must equal this bit for bit, on an input within the
calibration range and on one four times larger, where the input quantization and the output
clamp really saturate at both ends of the int8 range.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvm_layerfuse.vta import pipeline
from tvm_layerfuse.vta.graph import ConvOp
from tvm_layerfuse.vta.quantize import random_samples

C, HW = 16, 8


def round_half_up(v: np.ndarray) -> np.ndarray:
    """Nearest integer, ties towards +inf (exact in float64 for these magnitudes)."""
    return np.floor(np.asarray(v, dtype=np.float64) + 0.5)


def int8(v: np.ndarray) -> np.ndarray:
    return np.clip(v, -128, 127)


def conv_int(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """3x3, stride 1, pad 1 conv in exact integers: x [1, C, H, W], w [O, C, 3, 3] -> [1, O, H, W]."""
    xp = np.pad(x.astype(np.int64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((1, w.shape[0], HW, HW), np.int64)
    for i in range(3):
        for j in range(3):
            out += np.einsum("nchw,oc->nohw", xp[:, :, i : i + HW, j : j + HW], w[:, :, i, j].astype(np.int64))
    return out


@pytest.fixture(scope="module")
def single_conv():
    rng = np.random.default_rng(40)
    w = (rng.standard_normal((C, C, 3, 3)) * 0.15).astype(np.float32)
    w[3] *= 0.05  # a channel with small weights: its own (larger) weight scale, a larger shift
    b = (rng.standard_normal(C) * 0.3).astype(np.float32)
    node = helper.make_node("Conv", ["input", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1], kernel_shape=[3, 3])
    graph = helper.make_graph(
        [node], "single_conv",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, C, HW, HW])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C, HW, HW])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    build = pipeline.build(model, n_calibration=4, seed=41)
    return w.astype(np.float64), b.astype(np.float64), build


def _expected(w, b, build, x: np.ndarray) -> np.ndarray:
    q = build.quantization
    (op,) = [op for op in build.graph.ops if isinstance(op, ConvOp)]
    assert op.on_vta, op.reason
    f_x, f_out = q.frac["input"], q.frac["y"]
    f_w = np.asarray(q.weight_frac[op.name], dtype=np.int64)  # [C_out]
    for f, m in [(f_x, q.max_abs["input"]), (f_out, q.max_abs["y"])] + [(f_w[c], np.abs(w[c]).max()) for c in range(C)]:
        assert m * 2.0**f <= 127 < m * 2.0 ** (f + 1), (f, m)  # the scale's definition
    x_q = int8(round_half_up(x * 2.0**f_x))
    w_q = int8(round_half_up(w * 2.0 ** f_w.reshape(-1, 1, 1, 1).astype(np.float64)))
    big_f = f_x + f_w
    acc = conv_int(x_q, w_q) + round_half_up(b * 2.0 ** big_f.astype(np.float64)).astype(np.int64).reshape(1, -1, 1, 1)
    s = (big_f - f_out).reshape(1, -1, 1, 1).astype(np.float64)
    assert (s > 0).all(), "every channel requantizes by a right shift here"
    ties = int(np.sum(np.mod(acc / 2.0**s, 1.0) == 0.5))  # where round-half-up and half-even differ
    return int8(round_half_up(acc / 2.0**s)).astype(np.int64), f_out, ties


def test_requantization_matches_round_half_up_bit_for_bit(single_conv):
    w, b, build = single_conv
    x = random_samples(build.graph, 1, seed=42)[0]["input"].astype(np.float64)
    want, f_out, ties = _expected(w, b, build, x)
    assert ties > 0 and len(np.unique(want)) > 100
    assert -128 < want.min() and want.max() < 127, "within the calibration range: no clamp"
    got = build.run({"input": x.astype(np.float32)}).outputs["y"] * 2.0**f_out
    np.testing.assert_array_equal(got, want)


def test_saturation_at_both_ends_of_the_int8_range(single_conv):
    w, b, build = single_conv
    x = 4 * random_samples(build.graph, 1, seed=43)[0]["input"].astype(np.float64)
    want, f_out, _ = _expected(w, b, build, x)
    f_x = build.quantization.frac["input"]
    x_q = round_half_up(x * 2.0**f_x)
    assert (x_q > 127).any() and (x_q < -128).any(), "the input quantization must saturate"
    assert (want == 127).sum() > 20 and (want == -128).sum() > 20, "the output clamp must saturate"
    got = build.run({"input": x.astype(np.float32)}).outputs["y"] * 2.0**f_out
    np.testing.assert_array_equal(got, want)
