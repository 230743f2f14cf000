"""Small ONNX graphs for tests, written with onnx.helper, and the numeric checks on them.

``Net`` keeps track of each tensor's shape so weights can be sized; every random value
comes from one seeded generator.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from tvm_layerfuse.onnx_realize import realize
from tvm_layerfuse.planner import FusionPlan, plan
from tvm_layerfuse.testing.checks import output_mismatches
from tvm_layerfuse.topology.shape_folding import seeded_feeds

RTOL = 1e-4  # fp32: max |a - b| / max |a| against onnxruntime with optimisations off


class Net:
    def __init__(self, *, opset: int = 13, seed: int = 0) -> None:
        self.opset = opset
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.shape: dict[str, tuple[int, ...]] = {}
        self._n = 0

    def _name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def input(self, name: str, shape: Sequence[Optional[int]]) -> str:
        dims = [d if d is not None else "N" for d in shape]
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, dims))
        self.shape[name] = tuple(shape)
        return name

    def const(self, value: np.ndarray, name: Optional[str] = None) -> str:
        name = name or self._name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value), name=name))
        self.shape[name] = tuple(np.asarray(value).shape)
        return name

    def node(self, op: str, inputs: list[str], *, shape=None, name: Optional[str] = None, outputs: int = 1, **attrs) -> str:
        name = name or self._name(op.lower())
        outs = [f"{name}_out"] if outputs == 1 else [f"{name}_out{k}" for k in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, **attrs))
        for o in outs:
            self.shape[o] = tuple(shape) if shape is not None else self.shape[inputs[0]]
        return outs[0] if outputs == 1 else outs

    def conv(
        self,
        x: str,
        cout: int,
        *,
        k: int = 3,
        stride: int = 1,
        pad: Optional[int] = None,
        group: int = 1,
        dilation: int = 1,
        bias: bool = True,
        name: Optional[str] = None,
        weight_input: bool = False,
    ) -> str:
        n, cin, h, w = self.shape[x]
        pad = (k // 2) * dilation if pad is None else pad
        wv = (self.rng.standard_normal((cout, cin // group, k, k)) * np.sqrt(2.0 / (cin // group * k * k))).astype(
            np.float32
        )
        name = name or self._name("conv")
        if weight_input:
            wn = self.input(f"{name}_w", wv.shape)
        else:
            wn = self.const(wv, f"{name}_w")
        ins = [x, wn]
        if bias:
            ins.append(self.const((self.rng.standard_normal(cout) * 0.1).astype(np.float32), f"{name}_b"))
        ho = (h + 2 * pad - dilation * (k - 1) - 1) // stride + 1
        wo = (w + 2 * pad - dilation * (k - 1) - 1) // stride + 1
        return self.node(
            "Conv",
            ins,
            shape=(n, cout, ho, wo),
            name=name,
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[pad] * 4,
            dilations=[dilation, dilation],
            group=group,
        )

    def bn(self, x: str, *, name: Optional[str] = None, params_as_inputs: bool = False, eps: float = 1e-5) -> str:
        c = self.shape[x][1]
        name = name or self._name("bn")
        values = [
            self.rng.uniform(0.5, 1.5, c),  # scale
            self.rng.standard_normal(c) * 0.1,  # bias
            self.rng.standard_normal(c) * 0.1,  # mean
            self.rng.uniform(0.5, 1.5, c),  # var
        ]
        names = []
        for tag, v in zip(("scale", "bias", "mean", "var"), values):
            if params_as_inputs:
                names.append(self.input(f"{name}_{tag}", (c,)))
            else:
                names.append(self.const(v.astype(np.float32), f"{name}_{tag}"))
        return self.node("BatchNormalization", [x] + names, name=name, epsilon=eps)

    def channel_const(self, x: str, *, rank: int = 3, low: float = 0.5, high: float = 1.5) -> str:
        c = self.shape[x][1]
        v = self.rng.uniform(low, high, c).astype(np.float32)
        return self.const(v.reshape((c,) + (1,) * (rank - 1)))

    def relu(self, x: str, **kw) -> str:
        return self.node("Relu", [x], **kw)

    def concat(self, xs: list[str], *, axis: int = 1, name: Optional[str] = None) -> str:
        shape = list(self.shape[xs[0]])
        shape[axis] = sum(self.shape[x][axis] for x in xs)
        return self.node("Concat", xs, shape=shape, axis=axis, name=name)

    def maxpool(self, x: str, *, k: int = 3, stride: int = 1, pad: int = 1) -> str:
        n, c, h, w = self.shape[x]
        ho = (h + 2 * pad - k) // stride + 1
        wo = (w + 2 * pad - k) // stride + 1
        return self.node("MaxPool", [x], shape=(n, c, ho, wo), kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4)

    def build(self, outputs: list[str], *, name: str = "test") -> onnx.ModelProto:
        outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, list(self.shape[o])) for o in outputs]
        graph = helper.make_graph(self.nodes, name, self.inputs, outs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 8 if self.opset <= 17 else 10
        onnx.checker.check_model(model, full_check=True)
        return model


def feeds_for(model: onnx.ModelProto, *, seed: int = 1) -> dict[str, np.ndarray]:
    feeds = seeded_feeds(model, seed=seed)
    for name, v in feeds.items():
        if "_var" in name:
            feeds[name] = np.abs(v) + 0.5  # a variance fed at run time must be positive
    return feeds


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, extra_outputs: Sequence[str] = ()) -> list[np.ndarray]:
    if extra_outputs:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        for o in extra_outputs:
            m.graph.output.append(helper.make_empty_tensor_value_info(o))
        model = m
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(a).max(), 1e-30))


def assert_realizes(model: onnx.ModelProto, p: Optional[FusionPlan] = None, *, seed: int = 1) -> FusionPlan:
    """Plan ``model`` (unless given), write the fused model, and check both agree in onnxruntime."""
    p = p or plan(model)
    fused = realize(p, model)
    onnx.checker.check_model(fused)
    feeds = feeds_for(model, seed=seed)
    expected = run_ort(model, feeds)
    got = run_ort(fused, feeds)
    problems = output_mismatches(expected, got, names=[o.name for o in model.graph.output])
    assert not problems, "fused model differs: " + "; ".join(problems)
    return p


def compile_and_compare(model: onnx.ModelProto, *, seed: int = 1):
    """Layerfuse and TVM's default pipeline, both built for this CPU, against onnxruntime and
    against each other (fp32, ``RTOL``). Returns ``(fuse result, fused KernelCount, default
    KernelCount)``; every layerfuse group must be exactly one kernel named after its template."""
    import tvm

    from tvm_layerfuse.relax.pipeline import build, fuse_with_report, kernel_count, run, unfused

    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    feeds = feeds_for(model, seed=seed)
    expected = run_ort(model, feeds)
    result = fuse_with_report(model)
    fused_ex = build(result.mod, target=target)
    plain_ex = build(unfused(model), target=target)
    got = run(fused_ex, list(feeds.values()))
    base = run(plain_ex, list(feeds.values()))
    names = [o.name for o in model.graph.output]
    for what, ref, out in (("layerfuse vs onnxruntime", expected, got), ("TVM default vs onnxruntime", expected, base),
                           ("layerfuse vs TVM default", base, got)):  # fmt: skip
        problems = output_mismatches(ref, out, names=names)
        assert not problems, f"{what}: " + "; ".join(problems)
    kernels = kernel_count(fused_ex)
    ours = [n for n in kernels.names if n.startswith("layerfuse_")]
    # each epilogue group is one kernel, unless a BatchNorm+Relu prologue group took it in
    prologues = result.report["prologues"]
    absorbed = sum(1 for g in prologues if g.get("absorbs"))
    assert len(ours) == len(result.report["groups"]) - absorbed + len(prologues), (kernels.names, result.report["groups"])
    return result, kernels, kernel_count(plain_ex)


def run_runtime_only(artifact, feeds: dict[str, np.ndarray], tmp_path, *, env: Optional[dict] = None) -> dict[str, np.ndarray]:
    """The artifact's outputs for ``feeds``, computed in a fresh process with the TVM runtime
    only (``TVM_USE_RUNTIME_LIB=1``; ``env``: more variables for it); that process also checks
    that no ``tvm.relax`` was loaded."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    np.savez(tmp_path / "x.npz", **feeds)
    script = (
        "import sys, numpy as np\n"
        "from tvm_layerfuse.runtime import load\n"
        f"y = load({str(artifact)!r}).run(dict(np.load({str(tmp_path / 'x.npz')!r})))\n"
        f"np.savez({str(tmp_path / 'y.npz')!r}, **y)\n"
        "assert 'tvm.relax' not in sys.modules\n"
    )
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(env or {})}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with np.load(tmp_path / "y.npz") as y:
        return {k: y[k] for k in y.files}
