"""Live test weights, and the check that a model's outputs are alive.

The ONNX model-zoo "light" networks carry constant-filled weights (``ConstantOfShape``
0.02): every output is the same for any input, so a channel mix-up would not show.
Weights drawn without care are little better: a per-channel Mul after each BatchNorm
drawn as N(0, 0.1) shrinks the signal ~10x per layer (DenseNet's logits then differ by
1e-7 between inputs), uncalibrated BatchNorm statistics let activations grow to 1e4 and
saturate the softmax. A numeric test on such a model cannot fail.

:func:`live_weights` gives a model the same graph with seeded weights that keep every
activation O(1):

* Conv, Gemm and MatMul weights He-normal, ``N(0, 2 / fan_in)`` (fan_in: the weight's
  input dimensions: ``C_in/g * kh * kw`` for a conv, the contracted axis for a linear);
  their biases ``N(0, 0.1)``;
* BatchNormalization ``gamma ~ U(0.5, 1.5)``, ``beta ~ N(0, 0.1)``, and running statistics
  *calibrated*: a seeded standard-normal batch is propagated layer by layer (onnxruntime,
  one node at a time) and each BatchNorm's mean and variance are set to the per-channel
  statistics of the tensor it normalises, so ``(x - mean) / sqrt(var + eps)`` has mean 0
  and standard deviation 1 per channel on that batch;
* a Mul or Add with a constant operand (the per-channel scale and bias that Caffe2
  exports put after a BatchNorm) is a scale ``U(0.5, 1.5)`` / a bias ``N(0, 0.1)``;
* every other constant (shapes, Clip bounds, Reshape targets) is kept as it is.

:func:`liveness_problems` / :func:`assert_live` fail a test whose model is dead or
saturated: for two different seeded inputs, every output (and the logits before a final
Softmax, see :func:`with_logits`) must differ by more than 1 % of its magnitude, and no
more than half of its elements may sit at one value.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..topology.materialize import materialize_constants
from ..topology.onnx_reader import read_onnx
from ..topology.reference import session

LIVE_MIN_CHANGE = 0.01
"""Two different inputs must move every output by more than this fraction of its magnitude."""
LIVE_MAX_SHARE = 0.5
"""No more than this fraction of an output's elements may hold one value."""


# ---------------------------------------------------------------------- roles of the constants
def _roles(model: onnx.ModelProto) -> dict[str, tuple[str, int]]:
    """initializer name -> (role, fan_in) for the constants :func:`live_weights` redraws."""
    inits = {t.name: t for t in model.graph.initializer}
    role: dict[str, tuple[str, int]] = {}
    for node in model.graph.node:
        ins = list(node.input)
        if node.op_type == "BatchNormalization":
            for tag, name in zip(("bn_scale", "bn_bias", "bn_mean", "bn_var"), ins[1:5]):
                role[name] = (tag, 0)
        elif node.op_type == "Conv" and len(ins) > 1 and ins[1] in inits:
            dims = list(inits[ins[1]].dims)  # [C_out, C_in/g, kh, kw]
            role[ins[1]] = ("weight", int(np.prod(dims[1:])))
            if len(ins) > 2 and ins[2]:
                role[ins[2]] = ("bias", 0)
        elif node.op_type == "Gemm" and len(ins) > 1 and ins[1] in inits:
            dims = list(inits[ins[1]].dims)
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            role[ins[1]] = ("weight", dims[1] if trans_b else dims[0])  # B: [N, K] if transB else [K, N]
            if len(ins) > 2 and ins[2]:
                role[ins[2]] = ("bias", 0)
        elif node.op_type == "MatMul" and len(ins) > 1 and ins[1] in inits:
            dims = list(inits[ins[1]].dims)  # [..., K, N]
            role[ins[1]] = ("weight", dims[-2] if len(dims) > 1 else dims[0])
        elif node.op_type in ("Mul", "Add", "Sum"):
            for name in ins:
                if name in inits and name not in role:
                    role[name] = ("scale" if node.op_type == "Mul" else "bias", 0)
    return {
        name: r
        for name, r in role.items()
        if name in inits and inits[name].data_type == onnx.TensorProto.FLOAT
    }


def _draw(rng: np.random.Generator, tag: str, fan_in: int, shape: Sequence[int]) -> np.ndarray:
    if tag == "weight":
        return rng.standard_normal(shape) * np.sqrt(2.0 / max(fan_in, 1))  # He-normal
    if tag in ("bn_scale", "scale"):
        return rng.uniform(0.5, 1.5, shape)
    if tag == "bn_var":
        return np.ones(shape)  # calibrated below
    if tag == "bn_mean":
        return np.zeros(shape)  # calibrated below
    return rng.standard_normal(shape) * 0.1  # biases, BatchNorm beta


# ---------------------------------------------------------------------- one node in onnxruntime
def _elem_type(v: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype)


def _run_node(model: onnx.ModelProto, node: onnx.NodeProto, values: dict[str, np.ndarray], inits: dict) -> list:
    """``node``'s outputs on ``values`` (onnxruntime, optimisations off)."""
    ins = [i for i in dict.fromkeys(node.input) if i]
    graph_inits = [inits[i] for i in ins if i in inits]
    graph_inputs = [
        helper.make_tensor_value_info(i, _elem_type(values[i]), list(np.shape(values[i]))) for i in ins if i not in inits
    ]
    outs = [helper.make_empty_tensor_value_info(o) for o in node.output if o]
    g = helper.make_graph([node], "one_node", graph_inputs, outs, graph_inits)
    m = helper.make_model(g, opset_imports=model.opset_import)
    m.ir_version = max(model.ir_version, 4)  # initializers need not be graph inputs
    return session(m).run(None, {i.name: values[i.name] for i in graph_inputs})


def calibration_feeds(model: onnx.ModelProto, *, seed: int) -> dict[str, np.ndarray]:
    """A seeded standard-normal value for every graph input that is no initializer."""
    from ._builder import random_inputs

    return random_inputs(model, seed=seed)


# ---------------------------------------------------------------------- the weights
def live_weights(model: onnx.ModelProto, *, seed: int) -> onnx.ModelProto:
    """A copy of ``model`` (constants as initializers) with seeded live float32 weights and
    calibrated BatchNorm statistics (see the module doc)."""
    out = materialize_constants(model, read_onnx(model))
    rng = np.random.default_rng(seed)
    roles = _roles(out)
    inits: dict[str, onnx.TensorProto] = {}
    for t in out.graph.initializer:
        if t.name in roles:
            tag, fan_in = roles[t.name]
            t = numpy_helper.from_array(_draw(rng, tag, fan_in, tuple(t.dims)).astype(np.float32), t.name)
        inits[t.name] = t

    # propagate a seeded batch node by node; calibrate each BatchNorm on what reaches it
    bns = [i for i, n in enumerate(out.graph.node) if n.op_type == "BatchNormalization"]
    values: dict[str, np.ndarray] = dict(calibration_feeds(out, seed=seed + 1))
    calibrated: set[str] = set()
    for node in out.graph.node[: bns[-1] + 1 if bns else 0]:
        if node.op_type == "BatchNormalization" and node.input[3] not in calibrated:
            x = values[node.input[0]].astype(np.float64)  # [N, C, ...]
            axes = (0,) + tuple(range(2, x.ndim))
            eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
            mean = x.mean(axis=axes)  # [C]
            var = np.maximum(x.var(axis=axes) - eps, 1e-6)  # so that x's variance + eps is var + eps
            inits[node.input[3]] = numpy_helper.from_array(mean.astype(np.float32), node.input[3])
            inits[node.input[4]] = numpy_helper.from_array(var.astype(np.float32), node.input[4])
            calibrated.update(node.input[3:5])
        for name, v in zip([o for o in node.output if o], _run_node(out, node, values, inits)):
            values[name] = v
    del out.graph.initializer[:]
    out.graph.initializer.extend(inits.values())
    return out


# ---------------------------------------------------------------------- liveness
def with_logits(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the input of every Softmax/LogSoftmax that produces a graph output added
    as an extra graph output (after the original ones): a saturated softmax hides almost any
    error of its logits, so tests compare both. The model itself when there is none."""
    declared = {o.name for o in model.graph.output}
    logits = [
        n.input[0]
        for n in model.graph.node
        if n.op_type in ("Softmax", "LogSoftmax") and n.output[0] in declared and n.input[0] not in declared
    ]
    if not logits:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for name in dict.fromkeys(logits):
        m.graph.output.append(helper.make_empty_tensor_value_info(name))
    known = {v.name: v for v in onnx.shape_inference.infer_shapes(m).graph.value_info}
    for o in m.graph.output:
        if not o.type.HasField("tensor_type") and o.name in known:
            o.CopyFrom(known[o.name])
    return m


def liveness_problems(
    model: onnx.ModelProto, *, seed: int = 0, feeds: Optional[Sequence[dict[str, np.ndarray]]] = None
) -> list[str]:
    """Why ``model``'s outputs (and logits, see :func:`with_logits`) cannot show an error:
    an output that two different inputs move by no more than ``LIVE_MIN_CHANGE`` of its
    magnitude (dead), or with more than ``LIVE_MAX_SHARE`` of its elements at one value
    (saturated). Empty when every output is alive. ``feeds``: the two inputs (default:
    seeded standard-normal ones)."""
    from .checks import run_onnxruntime

    m = with_logits(model)
    a_feeds, b_feeds = feeds or (calibration_feeds(m, seed=seed), calibration_feeds(m, seed=seed + 1))
    names = [o.name for o in m.graph.output]
    problems = []
    for name, a, b in zip(names, run_onnxruntime(m, a_feeds), run_onnxruntime(m, b_feeds)):
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        size = float(max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0)))
        change = float(np.abs(a - b).max(initial=0.0))
        if not np.isfinite(size) or change <= LIVE_MIN_CHANGE * size or size == 0.0:
            problems.append(f"output {name!r} is dead: two inputs change it by {change:.3g}, its magnitude is {size:.3g}")
        for v in (a, b):
            _, counts = np.unique(v, return_counts=True)
            share = counts.max(initial=0) / max(v.size, 1)
            if v.size > 1 and share > LIVE_MAX_SHARE:
                problems.append(f"output {name!r} is saturated: {share:.0%} of its elements hold one value")
                break
    return problems


def assert_live(model: onnx.ModelProto, *, seed: int = 0) -> None:
    """Fail (AssertionError) when :func:`liveness_problems` finds any."""
    problems = liveness_problems(model, seed=seed)
    assert not problems, "the test model cannot show a numeric error: " + "; ".join(problems)
