"""The host steps of a VTA network compiled by TVM: one Relax function per host op, one library.

What VTA does not run (the stem conv on the image, pools, LRN, the classifier, softmax,
epilogues its ALU has no form for) runs on the host CPU. The artifact describes each host op
as *host steps* (:func:`tvm_layerfuse.compile.vta.quantize.host_program`: ``conv``, ``add``,
``acts``, ``slice``, ``concat`` and ``layer`` = one ONNX op); numpy interprets them
(:func:`tvm_layerfuse.runtime.vta.host.run_steps`, the reference). Here the same steps become code::

    host steps of op k ─► ONNX model (float64; the op's reads -> its writes)
                      ─► tvm_layerfuse.relax.importer.import_onnx (TVM's ONNX frontend)
                      ─► Relax function host_k (reads..., weights...) -> writes
    all host_k        ─► one IRModule ─► tvm.compile for the preset's host target ─► host.so

The computation stays in float64, as the numpy steps compute: the two agree to float64
rounding (~1e-16 relative), so the int8 tensors quantized from host outputs are the numpy
reference's, and steps on quantized values (max pools, sums of dequantized int8) are exact.
ONNX ops whose TVM converter builds float32 constants regardless of the input type (``LRN``)
are written out in ops that keep the type. The weights of the host steps stay in
``host.npz`` (function parameters, listed per op in ``vta.json``), not in the library.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...errors import BuildError, first_line

log = logging.getLogger(__name__)

DOUBLE = TensorProto.DOUBLE


@dataclass(frozen=True)
class HostFunction:
    """One compiled host op: ``function(*reads, *[consts[k] for k in params]) -> writes``."""

    op: str
    function: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    params: tuple[str, ...]  # keys of host.npz, in the function's parameter order


@dataclass(frozen=True)
class HostLibrary:
    """The exported library and what it holds (``vta.json``'s ``host_library``)."""

    path: Path
    functions: tuple[HostFunction, ...]
    target: dict[str, Any]
    machine: str

    def manifest(self, file: str) -> dict[str, Any]:
        return {"file": file, "target": self.target, "machine": self.machine, "functions": [f.function for f in self.functions]}


class _Onnx:
    """An ONNX graph under construction: SSA names for the host steps' reassignments."""

    def __init__(self, consts: Mapping[str, np.ndarray], *, prefix: str) -> None:
        self.consts = consts
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.weight_keys: dict[str, str] = {}  # initializer name -> host.npz key
        self.current: dict[str, str] = {}  # logical tensor -> ONNX value holding it now
        self._count = 0

    def fresh(self) -> str:
        self._count += 1
        return f"{self.prefix}t{self._count}"

    def value(self, name: str) -> str:
        return self.current.get(name, name)

    def const(self, key: str) -> str:
        """A host constant: float tensors are weights (initializers: function parameters fed
        from host.npz); integers and scalars are compile-time constants (shapes, bounds)."""
        v = np.asarray(self.consts[key])
        if v.dtype.kind != "f" or v.size <= 1:
            return self.literal(v.astype(np.float64) if v.dtype.kind == "f" else v)
        known = {k: n for n, k in self.weight_keys.items()}
        if key not in known:
            name = f"{self.prefix}w{len(self.weight_keys)}"
            self.initializers[name] = numpy_helper.from_array(v.astype(np.float64), name)
            self.weight_keys[name] = key
            return name
        return known[key]

    def literal(self, v: np.ndarray) -> str:
        name = self.fresh()
        self.nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(v), name)))
        return name

    def node(self, op_type: str, inputs: Sequence[str], out: Optional[str] = None, **attrs: Any) -> str:
        result = self.fresh()
        self.nodes.append(helper.make_node(op_type, list(inputs), [result], **attrs))
        if out is not None:
            self.current[out] = result
        return result


def host_onnx(
    steps: Sequence[Mapping[str, Any]],
    consts: Mapping[str, np.ndarray],
    *,
    reads: Sequence[str],
    writes: Sequence[str],
    shapes: Mapping[str, Sequence[int]],
    opset: int,
    name: str = "host",
) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The float64 ONNX model of one host op's steps (inputs ``in0..`` = ``reads``, outputs
    ``out0..`` = ``writes``), and ``{initializer: host.npz key}``."""
    g = _Onnx(consts, prefix="h_")
    # the op's tensors under plain names (the function's parameters are positional; TVM's
    # importer would rename "/conv1/Relu_output_0" with a warning)
    inputs = {r: f"in{k}" for k, r in enumerate(reads)}
    g.current.update(inputs)
    for st in steps:
        op = st["op"]
        if op == "conv":
            x = g.value(st["in"])
            g.node("Conv", [x, g.const(st["w"]), g.const(st["b"])], st["out"], strides=list(st["strides"]), pads=list(st["pads"]))
        elif op == "add":
            _add_chain(g, [g.value(n) for n in st["in"]], st["out"])
        elif op == "acts":
            y = g.value(st["in"])
            for a in st["acts"]:
                if a["kind"] == "relu":
                    y = g.node("Relu", [y])
                else:  # np.clip(y, lo, hi) with an open side where a bound is None
                    lo = g.literal(np.array(a["lo"], np.float64)) if a.get("lo") is not None else ""
                    hi = g.literal(np.array(a["hi"], np.float64)) if a.get("hi") is not None else ""
                    y = g.node("Clip", [y, lo, hi])
            g.current[st["out"]] = y
        elif op == "slice":
            _slice(g, g.value(st["in"]), st["c0"], st["c1"], st["out"], opset=opset)
        elif op == "concat":
            g.node("Concat", [g.value(n) for n in st["in"]], st["out"], axis=1)
        elif op == "layer":
            args = ["" if a is None else g.const(a["const"]) if isinstance(a, dict) else g.value(a) for a in st["in"]]
            _layer(g, st["op_type"], dict(st["attrs"]), args, st["out"], shapes=shapes, opset=opset)
        else:
            raise BuildError(f"host step {op!r} is unknown; expected conv, add, acts, slice, concat or layer - report this model")
    outputs = []
    for k, w in enumerate(writes):
        g.nodes.append(helper.make_node("Identity", [g.value(w)], [f"out{k}"]))
        outputs.append(helper.make_tensor_value_info(f"out{k}", DOUBLE, list(shapes[w])))
    graph = helper.make_graph(
        g.nodes, name, [helper.make_tensor_value_info(inputs[r], DOUBLE, list(shapes[r])) for r in reads], outputs,
        list(g.initializers.values()),
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="tvm_layerfuse.vta")
    return model, dict(g.weight_keys)


def _add_chain(g: _Onnx, values: Sequence[str], out: Optional[str]) -> str:
    """``((a + b) + c) + ...``: the numpy steps' order of addition."""
    acc = values[0]
    for v in values[1:]:
        acc = g.node("Add", [acc, v])
    if out is not None:
        g.current[out] = acc
    return acc


def _slice(g: _Onnx, x: str, c0: int, c1: int, out: str, *, opset: int) -> None:
    """Channels ``[c0, c1)`` (axis 1)."""
    if opset >= 10:
        ints = [g.literal(np.array([v], np.int64)) for v in (c0, c1, 1)]
        g.node("Slice", [x, *ints], out)
    else:
        g.node("Slice", [x], out, starts=[c0], ends=[c1], axes=[1])


def _layer(g: _Onnx, op_type: str, attrs: dict[str, Any], args: list[str], out: str, *, shapes, opset: int) -> None:
    """One ONNX op as the model has it; LRN in ops that keep float64 (TVM's LRN converter
    multiplies by float32 constants whatever the input type)."""
    if op_type == "LRN":
        _lrn(g, args[0], attrs, out, shape=shapes[out])
        return
    if op_type == "Sum":
        _add_chain(g, args, out)
        return
    g.node(op_type, _trim(args), out, **attrs)


def _trim(args: list[str]) -> list[str]:
    """Omitted trailing optional inputs are left out (``""`` keeps a position in the middle)."""
    while args and args[-1] == "":
        args = args[:-1]
    return args


def _lrn(g: _Onnx, x: str, attrs: Mapping[str, Any], out: str, *, shape: Sequence[int]) -> None:
    """``y = x / (bias + alpha / size * sum_{window(c)} x**2) ** beta``, the window
    ``[c - floor((size-1)/2), c + ceil((size-1)/2)]`` cut at the channel range (zeros outside)."""
    size = int(attrs["size"])
    alpha, beta, bias = float(attrs.get("alpha", 1e-4)), float(attrs.get("beta", 0.75)), float(attrs.get("bias", 1.0))
    n, c = int(shape[0]), int(shape[1])
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = g.node("Mul", [x, x])  # [N, C, ...]
    parts = []
    if lo:
        parts.append(g.literal(np.zeros((n, lo, *shape[2:]), np.float64)))
    parts.append(sq)
    if hi:
        parts.append(g.literal(np.zeros((n, hi, *shape[2:]), np.float64)))
    padded = g.node("Concat", parts, axis=1) if len(parts) > 1 else sq  # [N, C + size - 1, ...]
    windows = []
    for j in range(size):
        ints = [g.literal(np.array([v], np.int64)) for v in (j, j + c, 1)]
        windows.append(g.node("Slice", [padded, *ints]))
    total = _add_chain(g, windows, None)  # [N, C, ...]
    scaled = g.node("Mul", [g.literal(np.array(alpha / size, np.float64)), total])
    base = g.node("Add", [g.literal(np.array(bias, np.float64)), scaled])
    denom = g.node("Pow", [base, g.literal(np.array(beta, np.float64))])
    g.node("Div", [x, denom], out)


def build_host_library(
    ops: Sequence[Mapping[str, Any]],
    consts: Mapping[str, np.ndarray],
    *,
    shapes: Mapping[str, Sequence[int]],
    opset: int,
    spec: Any,
    machine: str,
    out_dir: Path,
    file: str,
) -> HostLibrary:
    """Compile the host ops of a VTA module (its ``vta.json`` ``ops`` of kind ``host``) into
    ``out_dir / file`` for ``spec`` (a :class:`tvm_layerfuse.compile.presets.TargetSpec`; its
    ``host`` target when it has one, else its ``target``). ``out_dir`` should be private:
    LLVM ends the process on an I/O error (see :mod:`tvm_layerfuse.compile.build`)."""
    import tvm
    from tvm import relax

    from ...relax._ir import tvm_compile
    from ...relax.importer import import_onnx
    from ..build import export_library

    functions: list[HostFunction] = []
    module: dict[Any, Any] = {}
    for k, op in enumerate(o for o in ops if o["kind"] == "host"):
        fname = f"host_{k}"
        model, weight_keys = host_onnx(op["steps"], consts, reads=op["reads"], writes=op["writes"], shapes=shapes, opset=opset, name=fname)
        try:
            mod, params, _ = import_onnx(model)
        except Exception as e:  # noqa: BLE001 - the op's one line, whatever the importer raised
            raise BuildError(
                f"host op {op['name']!r} of the VTA network cannot be compiled by TVM ({first_line(e, last=True)}); "
                "expected ops TVM's ONNX importer takes - use the cpu target for this model"
            ) from None
        others = [gv.name_hint for gv in mod.get_global_vars() if gv.name_hint != "main"]
        if others:  # names would collide across host ops in one module
            raise BuildError(
                f"host op {op['name']!r} imported with helper functions {others}; expected plain Relax ops - report this model"
            )
        # constants the importer lifted into parameters (Clip's bounds, LRN's zero padding) go back in
        lifted = {name: value for name, value in params.items() if name not in weight_keys}
        if lifted:
            mod = relax.transform.BindParams("main", lifted)(mod)
        main = mod["main"]
        num_input = len(op["reads"])
        keys = [weight_keys[var.name] for var in main.params[num_input:]]
        module[fname] = main.with_attr("global_symbol", fname).with_attr("num_input", num_input)
        functions.append(HostFunction(op["name"], fname, tuple(op["reads"]), tuple(op["writes"]), tuple(keys)))
    ir = tvm.IRModule({tvm.ir.GlobalVar(name): f for name, f in module.items()})
    target = dict(spec.host or spec.target)  # the CPU beside the VTA
    tgt = tvm.target.Target(target)
    try:
        with tgt:
            ex = tvm_compile(ir, target=tgt, relax_pipeline=relax.get_default_pipeline(tgt))
    except Exception as e:  # noqa: BLE001
        raise BuildError(f"TVM could not build the VTA host steps for {spec.preset}: {first_line(e, last=True)}") from None
    export_library(ex, Path(out_dir) / file, spec)
    log.info("VTA host steps: %d functions compiled for %s", len(functions), spec.preset)
    return HostLibrary(Path(out_dir) / file, tuple(functions), target, machine)


def attach(module: Any, lib: HostLibrary, *, file: str) -> None:
    """Make ``module`` (a :class:`tvm_layerfuse.runtime.vta.runtime.VTAModule` about to be written)
    name the library: ``host_library`` in its manifest, ``function`` and ``params`` on each
    host op."""
    by_op = {f.op: f for f in lib.functions}
    ops = []
    for op in module.manifest["ops"]:
        if op["kind"] == "host":
            f = by_op[op["name"]]
            op = {**op, "function": f.function, "params": list(f.params)}
        ops.append(op)
    module.manifest = {**module.manifest, "ops": ops, "host_library": lib.manifest(file)}
