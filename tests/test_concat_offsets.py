"""Concat offsets off the common path: a nested concatenation at a non-zero offset, and a
horizontally merged conv whose second piece feeds a concatenation. Both on the TVM tactic
(``InPlaceConcat`` in the lowering) and on the oneDNN tactic (``concat_convs``), through the
path users run (``compile_model`` -> artifact -> ``runtime.load``), compared with onnxruntime
(optimisations off, rel. error <= 1e-4). A piece written at the wrong offset, or a merged
conv's piece given the wrong rows of the bias, changes the numbers.

Channel counts are multiples of 16 so that the oneDNN tactic takes its blocked in-place path
(``nChw16c``: a channel range of a concat is one contiguous chunk there).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from graphs import Net, feeds_for, run_ort
from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.compile.tactics import onednn
from tvm_layerfuse.runtime import load
from tvm_layerfuse.testing.checks import output_mismatches

MISSING = onednn.availability()
NEEDS_ONEDNN = pytest.mark.skipif(MISSING is not None, reason=f"oneDNN is not installed here: {MISSING}")
TACTICS = ["tvm", pytest.param("onednn", marks=NEEDS_ONEDNN)]
H = W = 8


def _conv_relu(n: Net, x: str, cout: int, k: int = 1) -> str:
    return n.relu(n.conv(x, cout, k=k))


def compile_run_check(model: onnx.ModelProto, tmp_path, tactics: str) -> dict:
    """compile -> load -> run; every output within 1e-4 of onnxruntime; the manifest."""
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    out = compile_model(path, tmp_path / f"m-{tactics}", target="cpu", progress=False, tactics=tactics, winograd="never")
    names = [o.name for o in model.graph.output]
    for seed in (1, 2):
        feeds = feeds_for(model, seed=seed)
        expected = run_ort(model, feeds)
        assert all(np.abs(e).max() > 1e-2 for e in expected), "dead outputs would prove nothing"
        got = load(out).run(feeds)
        problems = output_mismatches(expected, [got[n] for n in names], names=names)
        assert not problems, f"tactics {tactics}: " + "; ".join(problems)
    return json.loads((out / "manifest.json").read_text())


def nested_concat_model() -> onnx.ModelProto:
    """``outer = Concat(a, inner)``, ``inner = Concat(b, c)``: inner starts at channel 16 of
    outer. A conv reads ``inner`` as well, so TVM's FuseOps keeps it a kernel of its own (it
    would otherwise fuse the two concats into one six-input copy)."""
    n = Net(seed=21)
    x = n.input("x", (1, 16, H, W))
    a = _conv_relu(n, x, 16)
    b = _conv_relu(n, x, 32, k=3)
    c = _conv_relu(n, n.maxpool(x), 16)
    inner = n.concat([b, c], name="inner")
    outer = n.concat([a, inner], name="outer")
    return n.build([_conv_relu(n, outer, 16), _conv_relu(n, inner, 16)])


@pytest.mark.parametrize("tactics", TACTICS)
def test_nested_concat_at_a_nonzero_offset(tactics, tmp_path):
    manifest = compile_run_check(nested_concat_model(), tmp_path, tactics)
    kernels = manifest["fusion"]["kernels"]
    assert manifest["tactics"]["used"] == tactics
    if tactics == "tvm":  # inner is a view of outer's block at channel 16; no copy at all
        assert kernels["concat_kernels"] == 0 and kernels["concat_bytes_copied"] == 0, kernels
    else:  # inner's convs write into inner's block; outer's conv writes its range, inner is copied in
        concats = sorted(c["kernel"] for c in manifest["tactics"]["layers"] if c["layer"].startswith("concat:"))
        assert concats == ["1 convs write their channels, 1 copied", "2 convs write their channels, 0 copied"], concats


def merged_second_piece_model() -> onnx.ModelProto:
    """Two 1x1 convs on ``x`` merge into one 48-channel conv; its piece 1 (channels
    [16, 48)) is the last input of the concat, piece 0 reaches it through a 3x3 conv."""
    n = Net(seed=22)
    x = n.input("x", (1, 16, H, W))
    r = _conv_relu(n, x, 16)  # piece 0
    a = _conv_relu(n, x, 32)  # piece 1 -> concat channels [32, 64)
    y = n.concat([_conv_relu(n, n.maxpool(x), 16), _conv_relu(n, r, 16, k=3), a])
    return n.build([_conv_relu(n, y, 16)])


@pytest.mark.parametrize("tactics", TACTICS)
def test_second_piece_of_a_merged_conv_feeds_the_concat(tactics, tmp_path):
    model = merged_second_piece_model()
    manifest = compile_run_check(model, tmp_path, tactics)
    plan = manifest["fusion"]["plan"]
    assert plan["horizontal"] == 1 and plan["concat_in_place"] == 1, plan
    kernels = manifest["fusion"]["kernels"]
    assert kernels["concat_kernels"] == 0 and kernels["concat_bytes_copied"] == 0 and kernels["split_kernels"] == 0, kernels
    if tactics == "onednn":
        (concat,) = [c for c in manifest["tactics"]["layers"] if c["layer"].startswith("concat:")]
        assert concat["kernel"] == "3 convs write their channels, 0 copied", concat
