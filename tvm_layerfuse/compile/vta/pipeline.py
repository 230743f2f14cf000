"""The VTA flow end to end: plan -> VTA ops -> int8 calibration -> programs -> simulator.

::

    plan(model) ─► lower_plan ─► [unfuse] ─► prepare (what runs where, storage)
                                         ─► calibrate (N inputs or seeded random, both forms)
                                         ─► compile_graph (programs + DRAM image) ─► execute

:func:`build` compiles the fused network and, with ``baseline=True``, the unfused one with
the same quantization (the reference point of the fusion gain). :func:`accuracy`
compares int8 outputs with fp32 onnxruntime outputs (top-1 agreement, max relative
error).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from ...planner import plan as make_plan
from ...runtime.vta.config import DEFAULT, VTAConfig
from ...runtime.vta.runtime import RunResult
from .codegen import CompiledVTA, compile_graph, prepare
from .executor import execute
from .graph import VTAGraph, lower_plan, placement, unfuse
from .quantize import Quantization, calibrate, random_samples, reference

log = logging.getLogger(__name__)


@dataclass
class VTABuild:
    """The fused network (and optionally its unfused baseline) compiled for one VTA configuration."""

    fused: CompiledVTA
    unfused: Optional[CompiledVTA]
    quantization: Quantization
    calibration: list[dict[str, np.ndarray]] = field(repr=False, default_factory=list)

    @property
    def graph(self) -> VTAGraph:
        return self.fused.graph

    def run(self, feeds: Mapping[str, np.ndarray], *, fused: bool = True) -> RunResult:
        return execute(self.fused if fused else self.unfused, feeds)

    def reference(self, feeds: Mapping[str, np.ndarray], *, fused: bool = True) -> dict[str, np.ndarray]:
        return reference((self.fused if fused else self.unfused).graph, self.quantization, feeds)

    def placement(self) -> list[dict[str, Any]]:
        return placement(self.graph)


def build(
    model: Any,
    *,
    cfg: VTAConfig = DEFAULT,
    calibration: Optional[Sequence[Mapping[str, np.ndarray]]] = None,
    n_calibration: int = 4,
    seed: int = 0,
    baseline: bool = False,
) -> VTABuild:
    """Compile ``model`` (ONNX path/ModelProto or a FusionPlan) for VTA (see module doc)."""
    p = model if hasattr(model, "second") else make_plan(model)
    fused = lower_plan(p)
    prepare(fused, cfg)
    split = unfuse(fused)
    prepare(split, cfg)
    samples = list(calibration) if calibration else random_samples(fused, n_calibration, seed=seed)
    _check_samples(fused, samples)
    q = calibrate(split, samples, share_from=fused)
    log.info("VTA: calibrated %d tensors on %d inputs", len(q.frac), len(samples))
    return VTABuild(compile_graph(fused, q, cfg), compile_graph(split, q, cfg) if baseline else None, q, samples)


def _check_samples(graph: VTAGraph, samples: Sequence[Mapping[str, np.ndarray]]) -> None:
    """Calibration inputs must name every graph input with its compiled shape."""
    from ...errors import InputError

    for k, feeds in enumerate(samples):
        if not isinstance(feeds, Mapping):
            raise InputError(f"calibration input {k} is a {type(feeds).__name__}; expected a dict of input name -> array - "
                             "pass [{'input': array}, ...]")
        for name in graph.inputs:
            if name not in feeds:
                raise InputError(f"calibration input {k} lacks {name!r}; expected the inputs {list(graph.inputs)} - add it")
            got, want = list(np.shape(feeds[name])), list(graph.shapes[name])
            if got != want:
                raise InputError(f"calibration input {k}: {name!r} has shape {got}; expected {want} - resize it")


def accuracy(b: VTABuild, onnx_model, inputs: Sequence[Mapping[str, np.ndarray]]) -> dict[str, float]:
    """int8 (simulator) vs fp32 (onnxruntime, optimisations off) on ``inputs``."""
    from ...topology.reference import session

    sess = session(onnx_model)
    out = b.graph.outputs[0]
    agree, rel = 0, 0.0
    for feeds in inputs:
        ref = sess.run([out], dict(feeds))[0].astype(np.float64)
        got = b.run(feeds).outputs[out]
        agree += int(np.argmax(ref.reshape(ref.shape[0], -1), 1)[0] == np.argmax(got.reshape(got.shape[0], -1), 1)[0])
        rel = max(rel, float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-12)))
    return {"inputs": len(inputs), "top1_agreement": agree / max(len(inputs), 1), "max_rel_error": rel}


def gain(b: VTABuild, feeds: Mapping[str, np.ndarray]) -> dict[str, dict[str, int]]:
    """Simulator counters of one inference, fused vs unfused (needs ``baseline=True``)."""
    if b.unfused is None:
        raise ValueError("build(..., baseline=True) compiles the unfused form this comparison needs")
    return {"fused": b.run(feeds).counters.to_dict(), "unfused": b.run(feeds, fused=False).counters.to_dict()}


def compile_vta(
    model_path: Any,
    out_dir: Any,
    *,
    config: Any = None,
    calibration: Any = None,
    n_calibration: int = 8,
    seed: int = 0,
    input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
    force: bool = False,
    on_commit: Optional[Callable[[], None]] = None,
    target: str = "vta",
) -> dict[str, Any]:
    """Compile an ONNX model for VTA into the artifact directory ``out_dir`` (atomically, as
    :func:`tvm_layerfuse.runtime.artifact.write_artifact` writes every target's artifact).

    ``target``: the preset (``vta`` or a JSON file with ``"device": "vta"``) whose ``host``
    (else ``target``) TVM target and ``cross_compiler`` build the host steps' library
    (:mod:`.host_library`): this machine's CPU for the simulator, the board's for a board.

    ``config``: a :class:`VTAConfig`, a path to a ``vta_config.json`` or None (VTA's
    default). ``calibration``: input dicts, or an ``.npz`` file (:func:`read_calibration`);
    None draws ``n_calibration`` seeded random inputs (with a file: at most
    ``n_calibration`` of its samples are used). ``force``: replace an existing artifact.
    Returns the report (:func:`report`) of the build, baseline included."""
    import tempfile
    from pathlib import Path

    from ...runtime import artifact
    from ...runtime.loader import this_machine
    from ...runtime.vta.config import load_config
    from ...runtime.vta.runtime import HOST_LIBRARY
    from ..presets import check_toolchain, resolve
    from .executor import to_module
    from .host_library import attach, build_host_library

    spec = resolve(target)
    if spec.device != "vta":
        from ...errors import UsageError

        raise UsageError(f"target {target!r} is for device {spec.device!r}; expected a VTA preset (\"device\": \"vta\") - use --target vta")
    check_toolchain(spec)
    machine = this_machine() if spec.machine == "host" else spec.machine
    cfg = config if isinstance(config, VTAConfig) else (load_config(config) if config is not None else DEFAULT)
    p = model_path if hasattr(model_path, "second") else make_plan(model_path, input_shapes=input_shapes)
    if isinstance(calibration, (str, Path)):
        calibration = read_calibration(calibration, {n: p.first.tensor(n).shape for n in p.first.inputs}, count=n_calibration)
    b = build(p, cfg=cfg, calibration=calibration, n_calibration=n_calibration, seed=seed, baseline=True)
    rep = report(b)
    module = to_module(b.fused)
    with tempfile.TemporaryDirectory(prefix="tvm_layerfuse_vta_host_") as private:
        lib = build_host_library(module.manifest["ops"], module.consts, shapes=b.graph.shapes, opset=p.first.opset, spec=spec,
                                 machine=machine, out_dir=Path(private), file=HOST_LIBRARY)  # fmt: skip
        attach(module, lib, file=HOST_LIBRARY)

        def fill(tmp: Path) -> dict[str, Any]:
            shutil.copyfile(lib.path, tmp / HOST_LIBRARY)
            module.write_files(tmp)
            return _manifest(p, b, rep, model_path, spec=spec, machine=machine)

        artifact.write_artifact(Path(out_dir), fill, overwrite=force, on_commit=on_commit)
    return rep


def _manifest(p: Any, b: VTABuild, rep: Mapping[str, Any], model: Any, *, spec: Any, machine: str) -> dict[str, Any]:
    """The artifact manifest every target shares (``runtime.artifact``): the ``library`` is
    ``vta.json`` (the op sequence: VTA programs and host steps), which names the TVM library
    of the host steps (``host.so``, built for ``machine``)."""
    from pathlib import Path

    import tvm

    from ... import __version__
    from ...runtime import artifact
    from ...runtime.vta.runtime import MANIFEST

    first = p.first

    def io(names):
        return [{"name": n, "shape": [int(d) for d in first.tensor(n).shape], "dtype": first.tensor(n).dtype} for n in names]

    source = Path(model) if isinstance(model, (str, Path)) else None
    return {
        "format": artifact.FORMAT,
        "format_version": artifact.FORMAT_VERSION,
        "created_by": f"tvm_layerfuse {__version__}",
        "model": {"name": p.model, "sha256": artifact.sha256_file(source) if source is not None and source.is_file() else None},
        "tvm_version": tvm.__version__,
        "target": {
            "preset": spec.preset,
            "description": "VTA programs (simulator or board) + host steps compiled by TVM for the host CPU",
            "device": "vta",
            "machine": machine,  # what host.so runs on
            "tvm_target": dict(spec.host or spec.target),
            "cross_compiler": spec.cross_compiler,
            "vta": b.fused.cfg.to_dict(),
        },
        "fused": True,
        "library": MANIFEST,
        "params": None,
        "inputs": io(first.inputs),
        "outputs": io(first.outputs),
        "fusion": {
            "plan": p.counts(),
            "groups": [g.to_dict() for g in p.groups],
            "refusals": [r.to_dict() for r in p.refusals],
            "vta": dict(rep),
        },
    }


def read_calibration(path: Any, shapes: Mapping[str, Sequence[int]], *, count: Optional[int] = None) -> list[dict[str, np.ndarray]]:
    """Calibration inputs from an ``.npz``: one entry per model input (any one name for a
    single-input model) holding ``[N, *input_shape]`` (N samples) or ``input_shape`` (one
    sample). The first ``count`` samples are used."""
    import zipfile
    from pathlib import Path

    from ...errors import InputError

    where = f"calibration file {str(path)!r}"
    if not Path(path).is_file():
        raise InputError(f"{where} does not exist; expected an .npz with one array per model input - check the path")
    try:
        z = np.load(path, allow_pickle=False)
        if not hasattr(z, "files"):  # an .npy: one array, no names
            raise InputError(f"{where} holds a single array; expected an .npz with one array per model input - save it with np.savez")
        with z:
            data = {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise InputError(f"{where} is not a readable .npz ({str(e).splitlines()[0][:120]}); expected arrays saved with np.savez - "
                         "re-save it") from None
    names = list(shapes)
    if len(names) == 1 and len(data) == 1:
        data = {names[0]: next(iter(data.values()))}
    missing = [n for n in names if n not in data]
    if missing:
        raise InputError(f"{where} lacks {missing[0]!r}; expected arrays named {names} - name them after the model inputs")
    stacks: dict[str, np.ndarray] = {}
    for n in names:
        a, want = np.asarray(data[n]), [int(d) for d in shapes[n]]
        if list(a.shape) == want:
            a = a[None]
        if list(a.shape[1:]) != want or a.shape[0] == 0 or a.dtype.kind not in "biuf":
            raise InputError(f"{where}: {n!r} has shape {list(a.shape)} ({a.dtype}); expected [N, {', '.join(map(str, want))}] "
                             "or the input shape itself, numeric - reshape it")
        stacks[n] = a.astype(np.float32)
    n_samples = min(len(a) for a in stacks.values())
    if count is not None:
        n_samples = min(n_samples, count)
    return [{n: stacks[n][k] for n in names} for k in range(n_samples)]


def report(b: VTABuild, *, seed: int = 100) -> dict[str, Any]:
    """What runs where, instructions per program, and one inference's counters, fused vs unfused."""
    feeds = random_samples(b.graph, 1, seed=seed)[0]
    out: dict[str, Any] = {
        "config": b.fused.cfg.summary(),
        "placement": b.placement(),
        "instructions": b.fused.instruction_counts(),
        "calibration_inputs": b.quantization.calibration_inputs,
    }
    if b.unfused is not None:
        out["counters"] = gain(b, feeds)
    return out


def format_report(rep: Mapping[str, Any]) -> str:
    """:func:`report` as text (what ``inspect --compile --target vta`` shows)."""
    cfg = rep["config"]
    lines = [
        f"VTA {cfg['TARGET']} block {cfg['block']}x{cfg['block']}, buffers (elements) "
        + ", ".join(f"{k} {v}" for k, v in cfg["depths"].items())
        + f"; calibrated on {rep['calibration_inputs']} input(s)",
        "",
        "layer placement:",
    ]
    instructions = rep["instructions"]
    for row in rep["placement"]:
        where = row["where"]
        extra = f"{instructions[row['op']]} instructions" if row["op"] in instructions else (row["reason"] or "")
        if where == "vta" and row["op"] not in instructions:
            extra = "in place (producers store at offsets)"
        lines.append(f"  {where:<5} {row['kind']:<18} {row['op']}  ({extra})")
    if "counters" in rep:
        u, f = rep["counters"]["unfused"], rep["counters"]["fused"]
        lines += ["", f"  {'one inference':<18}{'unfused':>12}{'fused':>12}{'change':>9}"]
        for k in ("inp_load_nbytes", "wgt_load_nbytes", "acc_load_nbytes", "uop_load_nbytes", "out_store_nbytes",
                  "dram_nbytes", "insn_count", "gemm_counter", "alu_counter"):
            change = (f[k] - u[k]) / u[k] * 100 if u[k] else 0.0
            lines.append(f"  {k:<18}{u[k]:>12}{f[k]:>12}{change:>8.1f}%")
    return "\n".join(lines)
