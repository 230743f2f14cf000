"""Post-training int8 quantization of the VTA graph with power-of-two scales.

Every activation tensor ``t`` gets ``f_t`` fractional bits: ``t ~ t_q * 2**-f_t`` with
``t_q`` int8, ``f_t = floor(log2(127 / max|t|))`` over the calibration inputs (the N
inputs given, or seeded random ones). Tensors that must share a scale share it (the
minimum ``f``): the inputs and output of a concat (producers store into one block),
the outputs of a horizontal merge (one requantization for the merged accumulator), and
the input and output of a MaxPool (max commutes with the scale, so the host pool is exact).

A conv's weights get one ``f_w[c]`` per output channel; channel ``c`` of the accumulator
then has ``F[c] = f_x + f_w[c]`` fractional bits and the epilogue is integer arithmetic
(VTA's ALU; per-channel shift amounts are accumulator vectors, SHR in register mode)::

    acc  = sum x_q * w_q + b_q                   b_q = round(b * 2**F) + r,  r = 2**(s-1) (s > 0)
    acc += res_q << (F - f_res)                  residual, aligned to F (a left shift: exact)
    acc  = acc >> s                              s = F - f_out  (round half up through r)
    acc  = max(acc, 0) | clamp(acc, lo_q, hi_q)  ReLU / Clip with bounds round(v * 2**f_out)
    y_q  = clamp(acc, -128, 127)

ReLU and Clip commute with the monotone rounding, so applying them after the shift is the
same as quantizing the float result. :func:`reference` runs the quantized graph in numpy
(the bit-exact target of the simulator); the host layers run in float on dequantized
values, exactly as in the simulator pipeline.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np

from ...errors import InputError
from ...runtime.vta import host
from ...runtime.vta.numerics import dequantize, quantize, shift_round
from .graph import Act, ConcatOp, ConvOp, EltwiseOp, HostOp, Op, VTAGraph

log = logging.getLogger(__name__)

F_MIN, F_MAX = -16, 24


# ---------------------------------------------------------------------- float execution
def run_float(graph: VTAGraph, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every tensor of ``graph`` computed in float64 (calibration and host fallback)."""
    values = {k: np.asarray(v, dtype=np.float64) for k, v in feeds.items()}
    for op in graph.ops:
        for name, value in zip(op.writes, float_op(graph, op, values)):
            values[name] = value
    return values


def float_op(graph: VTAGraph, op: Op, values: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """``op`` in float64 through its host program (the same steps an artifact runs)."""
    steps, consts = host_program(graph, op)
    local = dict(values)
    host.run_steps(steps, local, consts)
    return [local[o] for o in op.writes]


def host_program(graph: VTAGraph, op: Op) -> tuple[list[dict], dict[str, np.ndarray]]:
    """The host steps and constants that compute ``op`` in float (see :func:`host.run_steps`)."""
    if isinstance(op, ConvOp):
        w, b, y = f"{op.name}::W", f"{op.name}::b", f"{op.name}::y"
        steps = [{"op": "conv", "in": op.input, "w": w, "b": b, "strides": list(op.strides), "pads": list(op.pads), "out": y}]
        if op.residual:
            steps.append({"op": "add", "in": [y, op.residual], "out": y})
        if op.acts:
            steps.append({"op": "acts", "in": y, "acts": [vars(a) for a in op.acts], "out": y})
        steps += [{"op": "slice", "in": y, "c0": s.c0, "c1": s.c1, "out": s.tensor} for s in op.outputs]
        return steps, {w: op.weight, b: op.bias}
    if isinstance(op, EltwiseOp):
        y = f"{op.name}::y"
        steps = [
            {"op": "add", "in": list(op.inputs), "out": y},
            {"op": "acts", "in": y, "acts": [vars(a) for a in op.acts], "out": op.output},
        ]
        return steps, {}
    if isinstance(op, ConcatOp):
        return [{"op": "concat", "in": list(op.inputs), "out": op.output}], {}
    steps, consts = [], {}
    first = graph.first
    for name in op.layers:
        layer = first.layer(name)
        args = []
        for i in layer.inputs:
            if not i:
                args.append(None)
            elif first.is_constant(i):
                v = np.asarray(first.tensor(i).value())
                consts[i] = v.astype(np.float64) if v.dtype.kind == "f" else v
                args.append({"const": i})
            else:
                args.append(i)
        # extra outputs nobody reads (Dropout's mask) are fine: the step computes the first
        unused = all(not o or not first.consumers(o) and o not in first.outputs for o in layer.outputs[1:])
        if layer.op_type not in host.HOST_OPS or layer.domain or not unused:
            from ...errors import BuildError

            raise BuildError(
                f"layer {layer.name!r} ({layer.op_type}) has no host implementation in the VTA flow; expected one of "
                f"{', '.join(sorted(host.HOST_OPS))} - use the cpu target for this model"
            )
        steps.append({"op": "layer", "op_type": layer.op_type, "attrs": _layer_attrs(layer), "in": args, "out": layer.outputs[0]})
    return steps, consts


# ---------------------------------------------------------------------- scales
@dataclass
class Quantization:
    """Fractional bits of every activation tensor and of every VTA conv's weights."""

    frac: dict[str, int]
    weight_frac: dict[str, list[int]]  # per output channel
    max_abs: dict[str, float] = field(default_factory=dict)
    calibration_inputs: int = 0

    def to_dict(self) -> dict:
        return {"frac": dict(self.frac), "weight_frac": dict(self.weight_frac), "calibration_inputs": self.calibration_inputs}


def frac_bits(max_abs: float, *, qmax: int = 127) -> int:
    """Largest ``f`` with ``max_abs * 2**f <= qmax`` (clamped to a sane range)."""
    if not np.isfinite(max_abs) or max_abs <= 0:
        return 0
    return int(np.clip(np.floor(np.log2(qmax / max_abs)), F_MIN, F_MAX))


def share_groups(graph: VTAGraph) -> list[set[str]]:
    """Tensors that must have one scale (see module doc)."""
    parent: dict[str, str] = {}

    def find(a: str) -> str:
        while parent.setdefault(a, a) != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    def union(names: Sequence[str]) -> None:
        roots = [find(n) for n in names]
        for r in roots[1:]:
            parent[r] = roots[0]

    for op in graph.ops:
        if isinstance(op, ConcatOp):
            union(list(op.inputs) + [op.output])
        elif isinstance(op, ConvOp) and len(op.outputs) > 1:
            union(op.writes)
        elif isinstance(op, HostOp) and op.op_type == "MaxPool" and len(op.inputs) == 1:
            union([op.inputs[0], op.outputs[0]])
    groups: dict[str, set[str]] = {}
    for n in parent:
        groups.setdefault(find(n), set()).add(n)
    return [g for g in groups.values() if len(g) > 1]


def calibrate(graph: VTAGraph, samples: Sequence[Mapping[str, np.ndarray]], *, share_from: Optional[VTAGraph] = None) -> Quantization:
    """Scales from float runs of ``graph`` (use the unfused form: it names every intermediate).

    ``share_from``: the fused graph whose share groups apply too (so that both forms use
    one quantization)."""
    if not samples:
        raise InputError("calibration needs at least one input; expected N >= 1 samples - pass inputs or a seed")
    max_abs: dict[str, float] = {}
    for feeds in samples:
        for name, v in run_float(graph, feeds).items():
            m = float(np.max(np.abs(v))) if v.size else 0.0
            max_abs[name] = max(max_abs.get(name, 0.0), m)
    frac = {name: frac_bits(m) for name, m in max_abs.items()}
    # shared scales: the smallest f of each group; groups may chain through shared members
    groups = share_groups(graph) + (share_groups(share_from) if share_from is not None else [])
    changed = True
    while changed:
        changed = False
        for g in groups:
            f = min(frac[n] for n in g if n in frac)
            for n in g:
                if frac.get(n) != f:
                    frac[n], changed = f, True
    weight_frac = {}
    for op in graph.ops + (share_from.ops if share_from is not None else []):
        if isinstance(op, ConvOp):
            weight_frac[op.name] = [int(f) for f in weight_fracs(op.weight)]
    return Quantization(frac, weight_frac, max_abs, len(samples))


# ---------------------------------------------------------------------- integer parameters
@dataclass
class IntConv:
    """A conv's integer parameters (logical channel order; per output channel ``c``)."""

    w_q: np.ndarray  # [C_out, C_in, kh, kw] int8, scale 2**-f_w[c]
    b_q: np.ndarray  # [C_out] int64, scale 2**-F[c], rounding constant included
    shift: np.ndarray  # [C_out] s[c] = F[c] - f_out (negative: left shift)
    res_shift: np.ndarray  # [C_out] F[c] - f_res (left shift of the residual)
    lo: int  # final clamp, activations included
    hi: int


WEIGHT_FRAC_SPAN = 8
"""How many more fractional bits than the tensor-wide one a channel's weights may get."""


def weight_fracs(w: np.ndarray) -> np.ndarray:
    """Per-output-channel power-of-two weight scales (bounded by ``WEIGHT_FRAC_SPAN``)."""
    whole = frac_bits(float(np.max(np.abs(w))))
    per = np.array([frac_bits(float(np.max(np.abs(wc)))) if np.any(wc) else whole for wc in w], dtype=np.int64)
    return np.minimum(per, whole + WEIGHT_FRAC_SPAN)


def int_conv(op: ConvOp, q: Quantization) -> IntConv:
    f_x = q.frac[op.input]
    f_out = q.frac[op.outputs[0].tensor]
    f_w = np.asarray(q.weight_frac[op.name], dtype=np.int64)  # [C_out]
    # keep the requantization shift in -16..30 and the residual alignment in -15..30: at most
    # three SHR instructions each on the hardware (15 right or 16 left per instruction)
    f_w = np.maximum(np.minimum(f_w, f_out - f_x + 30), f_out - f_x - 16)
    if op.residual:
        f_res = q.frac[op.residual]
        f_w = np.maximum(np.minimum(f_w, f_res - f_x + 30), f_res - f_x - 15)
    big_f = f_x + f_w  # [C_out]
    shift = big_f - f_out
    w_q = np.clip(np.floor(op.weight * (2.0 ** f_w.astype(np.float64)).reshape(-1, 1, 1, 1) + 0.5), -128, 127).astype(np.int8)
    r = np.where(shift > 0, np.left_shift(1, np.maximum(shift - 1, 0)), 0)
    b_q = np.floor(op.bias * 2.0 ** big_f.astype(np.float64) + 0.5).astype(np.int64) + r
    res_shift = big_f - q.frac[op.residual] if op.residual else np.zeros_like(big_f)
    lo, hi = act_bounds(op.acts, f_out)
    return IntConv(w_q, np.clip(b_q, -(2**31), 2**31 - 1), shift, res_shift, lo, hi)


def act_bounds(acts: Sequence[Act], f_out: int) -> tuple[int, int]:
    """The int8 range after the activations, in the output scale."""
    lo, hi = -128, 127
    for a in acts:
        if a.kind == "relu":
            lo = max(lo, 0)
        else:
            if a.lo is not None:
                lo = max(lo, int(np.floor(a.lo * 2.0**f_out + 0.5)))
            if a.hi is not None:
                hi = min(hi, int(np.floor(a.hi * 2.0**f_out + 0.5)))
    return lo, max(lo, hi)


# ---------------------------------------------------------------------- numpy int8 reference
def reference(graph: VTAGraph, q: Quantization, feeds: Mapping[str, np.ndarray], *, trace: Optional[dict] = None) -> dict[str, np.ndarray]:
    """Run the quantized graph in numpy: VTA ops in integers, host ops in float.

    Returns the graph outputs (float64: dequantized where a VTA op produced them);
    ``trace`` (a dict) receives every int8 tensor VTA ops produce."""
    ints: dict[str, np.ndarray] = {}  # int8 NCHW
    floats: dict[str, np.ndarray] = {k: np.asarray(v, dtype=np.float64) for k, v in feeds.items()}

    def as_int(name: str) -> np.ndarray:
        if name not in ints:
            ints[name] = quantize(floats[name], q.frac[name])
        return ints[name]

    def as_float(name: str) -> np.ndarray:
        if name not in floats:
            floats[name] = dequantize(ints[name], q.frac[name])
        return floats[name]

    for op in graph.ops:
        if not op.on_vta:
            ins = {n: as_float(n) for n in op.reads}
            for name, v in zip(op.writes, float_op(graph, op, ins)):
                floats[name] = v
            continue
        if isinstance(op, ConvOp):
            p = int_conv(op, q)
            x = as_int(op.input).astype(np.int64)
            acc = host.conv2d(x, p.w_q.astype(np.int64), None, strides=op.strides, pads=op.pads)  # int64 exact
            acc = acc.astype(np.int64) + p.b_q.reshape(1, -1, 1, 1)
            if op.residual:
                acc = acc + shift_round(as_int(op.residual).astype(np.int64), -p.res_shift.reshape(1, -1, 1, 1))
            y = np.clip(shift_round(acc, p.shift.reshape(1, -1, 1, 1)), p.lo, p.hi).astype(np.int8)
            for s in op.outputs:
                ints[s.tensor] = y[:, s.c0 : s.c1]
        elif isinstance(op, EltwiseOp):
            y = eltwise_int(op, q, [as_int(n) for n in op.inputs])
            ints[op.output] = y
        elif isinstance(op, ConcatOp):
            ints[op.output] = np.concatenate([as_int(n) for n in op.inputs], axis=1)
    if trace is not None:
        trace.update(ints)
    return {o: as_float(o) for o in graph.outputs}


@dataclass
class IntEltwise:
    in_shifts: list[int]  # left shift of each input to the common F
    round_add: int
    shift: int
    lo: int
    hi: int


def int_eltwise(op: EltwiseOp, q: Quantization) -> IntEltwise:
    fs = [q.frac[n] for n in op.inputs]
    big_f = max(fs)
    f_out = q.frac[op.output]
    shift = big_f - f_out
    lo, hi = act_bounds(op.acts, f_out)
    return IntEltwise([big_f - f for f in fs], (1 << (shift - 1)) if shift > 0 else 0, shift, lo, hi)


def eltwise_int(op: EltwiseOp, q: Quantization, xs: Sequence[np.ndarray]) -> np.ndarray:
    p = int_eltwise(op, q)
    acc = sum(x.astype(np.int64) << s for x, s in zip(xs, p.in_shifts)) + p.round_add
    return np.clip(shift_round(acc, p.shift), p.lo, p.hi).astype(np.int8)


def random_samples(graph: VTAGraph, n: int, *, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``n`` seeded standard-normal inputs (calibration when the user gives none)."""
    rng = np.random.default_rng(seed)
    return [{name: rng.standard_normal(graph.shapes[name]).astype(np.float32) for name in graph.inputs} for _ in range(n)]


def _layer_attrs(layer) -> dict:
    """A layer's attributes as JSON-able values (what a host step stores)."""
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in layer.attrs.items() if not k.startswith("_")}
