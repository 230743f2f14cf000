"""TVM 0.27 + LLVM 22 reject valid code for SiLU on a 4x2x5 tensor; our builds work around it.

Found by ``test_fuzz_differential.py``'s larger graphs (a generated conv -> SiLU -> Sum graph,
reduced by ``reduce_case``): on the generic x86-64 target (``{"kind": "llvm"}``, what the
``cpu`` preset uses), a kernel that stores ``sigmoid(x)`` in a local buffer and then
multiplies it with ``x`` leaves LLVM's O3 pipeline with a ``shufflevector`` that does not
dominate its uses, and ``tvm.compile`` raises ``InternalError: LLVM module verification
failed ... Instruction does not dominate all uses!``. Off with LLVM's SLP vectorizer
(``cl-opt: -vectorize-slp=false``), with ``opt-level`` <= 2, or with ``mcpu=x86-64-v3``.
:func:`tvm_layerfuse.relax._ir.tvm_compile` builds such a module again without SLP.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper
from tvm.script import tirx as T

from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.relax._ir import LLVM_VERIFY_FAILED, tvm_compile
from tvm_layerfuse.runtime import load
from tvm_layerfuse.testing.checks import output_mismatches, run_onnxruntime
from tvm_layerfuse.testing.differential import check_case

GENERIC_X86 = tvm.target.Target({"kind": "llvm"})


@T.prim_func
def silu_4x2x5(x: T.Buffer((4, 2, 5), "float32"), y: T.Buffer((4, 2, 5), "float32")):
    T.func_attr({"tirx.noalias": True})
    s = T.alloc_buffer((4, 2, 5))
    for i, j, k in T.grid(4, 2, 5):
        s[i, j, k] = T.sigmoid(x[i, j, k])
    for i, j, k in T.grid(4, 2, 5):
        y[i, j, k] = x[i, j, k] * s[i, j, k]


def silu_model(shape=(1, 4, 2, 5)) -> onnx.ModelProto:
    """Two nodes: ``y = x * Sigmoid(x)`` (SiLU as torch exports it)."""
    graph = helper.make_graph(
        [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])],
        "silu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _run_prim(lib, x: np.ndarray) -> np.ndarray:
    y = tvm.runtime.tensor(np.zeros_like(x))
    lib["silu_4x2x5"](tvm.runtime.tensor(x), y)
    return y.numpy()


def test_tvm_alone_still_rejects_the_kernel():
    """The TVM bug itself (when this starts failing, TVM is fixed: drop the workaround)."""
    mod = tvm.IRModule({"silu_4x2x5": silu_4x2x5})
    with pytest.raises(Exception, match=LLVM_VERIFY_FAILED):
        tvm.compile(mod, target=GENERIC_X86)


def test_tvm_compile_builds_the_kernel_and_it_computes_silu():
    mod = tvm.IRModule({"silu_4x2x5": silu_4x2x5})
    lib = tvm_compile(mod, target=GENERIC_X86, relax_pipeline=None)
    x = np.random.default_rng(0).standard_normal((4, 2, 5)).astype(np.float32)
    expected = x / (1 + np.exp(-x.astype(np.float64)))
    np.testing.assert_allclose(_run_prim(lib, x), expected, rtol=1e-5, atol=1e-6)


def test_silu_model_compiles_and_matches_onnxruntime(tmp_path):
    model = silu_model()
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 4, 2, 5)).astype(np.float32)}
    # unfused, fused and lowered builds (the stages the fuzzer runs) ...
    res = check_case(model, feeds)
    assert res.findings == [], [f"{f.kind}: {f.detail}" for f in res.findings]
    # ... and the path users run: compile -> artifact -> runtime
    path = tmp_path / "silu.onnx"
    onnx.save(model, str(path))
    out = compile_model(path, tmp_path / "art", target="cpu", progress=False)
    got = [load(out).run(feeds)["y"]]
    assert not output_mismatches(run_onnxruntime(model, feeds), got)
