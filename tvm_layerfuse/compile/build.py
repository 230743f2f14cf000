"""Compile an ONNX model into an artifact for a target preset.

::

    plan            topology graph -> FusionPlan (what merges, and the report)
    import + fuse   Relax module with the merges carried out, weights still parameters
                    (``--no-fuse``: the same import, TVM's own pipeline only)
    weights         LiftTransformParams: every computation on weights alone (folded BN,
                    concatenated horizontal weights ...) runs once, here, on the build host;
                    oneDNN conv calls then get their weights packed in their primitives'
                    layout (tactics/prepack.py): the loaded module holds them once
    build           tvm.compile for the target (CPU: TVM's default Relax pipeline with its
                    FuseOps/FuseTIR; CUDA: plus dlight GPU schedules, nvcc fatbin)
    write           model.so (cross-linked for aarch64) + params.npz + manifest.json,
                    atomically

The weights stay beside the library (``params.npz``), so artifacts stay small and one
library serves several weight sets.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from .. import __version__
from ..errors import BuildError, first_line
from ..runtime import artifact
from ..runtime.io import savez
from .presets import TargetSpec, check_toolchain, resolve

log = logging.getLogger(__name__)

STEPS = ("plan", "import and fuse", "fold weights", "build", "write")


def compile_model(
    model: Any,
    out: Path,
    *,
    target: str = "cpu",
    arch: Optional[str] = None,
    fuse: bool = True,
    input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
    force: bool = False,
    progress: bool = True,
    on_commit: Optional[Callable[[], None]] = None,
    tactics: str = "auto",
    winograd: str = "timed",
) -> Path:
    """Compile ``model`` (ONNX path) for ``target`` into the artifact directory ``out``.

    ``on_commit()`` runs the instant the artifact is in place (see :func:`artifact.write_artifact`).
    ``tactics``: ``auto`` | ``onednn`` | ``tvm``, which implementation runs the conv layers
    (see :mod:`tvm_layerfuse.compile.tactics`); ``winograd``: ``timed`` | ``never`` | ``always``,
    how the oneDNN tactic chooses each 3x3 conv's algorithm."""
    spec = resolve(target, arch=arch)
    check_toolchain(spec)
    from tqdm import tqdm

    from ..planner import plan as make_plan

    timings: dict[str, float] = {}
    with tqdm(total=len(STEPS), disable=not progress, unit="step", leave=False) as bar:

        @contextlib.contextmanager
        def step(name: str):
            bar.set_description(name)
            t = time.perf_counter()
            yield
            timings[name] = round(time.perf_counter() - t, 3)
            bar.update(1)

        with step("plan"):
            p = make_plan(model, input_shapes=input_shapes)
        with step("import and fuse"):
            mod, params, report = relax_module(model, plan=p, fuse=fuse, input_shapes=input_shapes)
            from .tactics import apply_tactics

            mod, tactic_plan = apply_tactics(mod, params, spec, tactics=tactics, winograd=winograd)
        with step("fold weights"):
            mod, weights = lift_weights(mod, params)
            # the conv calls' weights, packed for this machine's oneDNN; an artifact for other CPUs
            # (cpu-portable) keeps them plain: the CPU that runs it reorders them once, at first use
            if tactic_plan.used == "onednn" and spec.host_cpu:
                from .tactics.prepack import prepack_weights

                mod, weights, tactic_plan.packing = prepack_weights(mod, weights)
            mod = safe_param_names(mod)
            outputs = program_outputs(mod, p.first.outputs)
        with step("build"):
            from .schedules import ScheduleReport

            schedules = ScheduleReport()
            ex = build_for(mod, spec, fuse=fuse, schedules=schedules)
            kernels = _kernel_count(ex)
        with step("write"), tempfile.TemporaryDirectory(prefix="tvm_layerfuse_export_") as private:
            names = [pv.name for pv in mod["main"].params][len(p.first.inputs) :]
            # Code generation and linking write first into a private directory: LLVM ends the
            # process on an I/O error (RLIMIT_FSIZE, ...), which must not leave a half-written
            # directory beside OUT. Only plain Python writes go into the artifact's own.
            library = Path(private) / artifact.LIBRARY
            export_library(ex, library, spec)

            def fill(tmp: Path) -> dict[str, Any]:
                shutil.copyfile(library, tmp / artifact.LIBRARY)
                if tactic_plan.library is not None:  # the tactic library travels with the model
                    from .tactics.onednn import LIBRARY_FILE

                    shutil.copyfile(tactic_plan.library, tmp / LIBRARY_FILE)
                savez(tmp / artifact.PARAMS, dict(zip(names, weights)))
                manifest = _manifest(
                    p, spec, fuse=fuse, names=names, report=report, kernels=kernels, model=model, outputs=outputs
                )
                manifest["tactics"] = tactic_plan.manifest()
                manifest["schedules"] = schedules.to_dict() if spec.device == "cpu" else None
                from .tune_database import applied_database, summary

                manifest["tuning"] = summary(applied_database(spec.target, spec.host, fuse=fuse))  # None: untuned
                return manifest

            artifact.write_artifact(Path(out), fill, overwrite=force, on_commit=on_commit)
    log.info("compiled %s for %s in %s", p.model, spec.preset, timings)
    return Path(out)


# ---------------------------------------------------------------------- stages
def relax_module(model: Any, *, plan: Any, fuse: bool, input_shapes=None):
    """(Relax module with weights as parameters, weight values by name, fusion report)."""
    from ..relax.importer import import_onnx
    from ..relax.pipeline import fuse_with_report

    if fuse:
        result = fuse_with_report(model, plan=plan, input_shapes=input_shapes, bind=False)
        return result.mod, result.params, result.report.to_dict()
    mod, params, _ = import_onnx(model, input_shapes=input_shapes)
    return mod, params, {}


def lift_weights(mod, params: Mapping[str, np.ndarray]):
    """Split ``main`` into weight preprocessing (run now, on this host) and inference.

    Returns the module whose ``main`` takes the inputs and the *transformed* weights, and
    those weights as numpy arrays in ``main``'s parameter order.
    """
    from ..relax.pipeline import lift_weights as lift

    main = mod["main"]
    num_input = int(main.attrs["num_input"])
    names = [pv.name for pv in main.params[num_input:]]
    missing = [n for n in names if n not in params]
    if missing:
        raise BuildError(f"no value for weight {missing[0]!r}; the import lost it - report this model")
    inference, values = lift(mod, [params[n] for n in names])
    return inference, [np.asarray(v.numpy()) for v in values]


def safe_param_names(mod):
    """Rename the parameters of every Relax function to C identifiers.

    Kernel arguments are named after them (through FuseTIR), and CUDA source does not
    compile with names like ``fire2/squeeze1x1_w_0``. Only names change: ``main`` keeps
    its parameter order, so the manifest's input and weight order stays valid.
    """
    from tvm import relax

    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = _rename_params(func)
    return mod


def _rename_params(func):
    from tvm import relax

    used: set[str] = set()
    new = []
    for pv in func.params:
        base = re.sub(r"\W", "_", pv.name) or "p"
        if base[0].isdigit():
            base = "p_" + base
        name, k = base, 1
        while name in used:
            k += 1
            name = f"{base}_{k}"
        used.add(name)
        new.append(relax.Var(name, pv.ty))
    if all(a.name == b.name for a, b in zip(func.params, new)):
        return func
    bound = func.bind_params(dict(zip(func.params, new)))
    return relax.Function(new, bound.body, bound.ret_ty, bound.is_pure, func.attrs)


def build_for(mod, spec: TargetSpec, *, fuse: bool = True, schedules=None):
    """tvm.compile for the preset with TVM's default Relax pipeline (the one that runs
    FuseOps/FuseTIR; GPU targets also get dlight schedules) - plus, when fusing, the lowering
    passes (in-place concat, split-output buffers) after FuseTIR; CPU kernels get the schedule
    rules of :mod:`.schedules` either way (``schedules``, a :class:`.schedules.ScheduleReport`,
    receives which rule scheduled each kernel). CUDA kernels go through nvcc."""
    from ..lowering import layerfuse_pipeline
    from ..lowering.pipeline import default_passes
    from ..relax._ir import tvm_compile

    tgt = spec.tvm_target()
    try:
        with contextlib.ExitStack() as scope:
            if spec.device == "cuda":
                from .cuda import nvcc_fatbin

                scope.enter_context(nvcc_fatbin(spec.arch))
            scope.enter_context(tgt)
            from .tune_database import applied_database

            db = applied_database(spec.target, spec.host, fuse=fuse)  # written by `tune` for this target
            db = str(db) if db is not None else None
            if db is not None:
                log.info("applying the tuning database %s", db)
            pipeline = layerfuse_pipeline(tgt, database=db) if fuse else default_passes(tgt, schedules=True)
            ex = tvm_compile(mod, target=tgt, relax_pipeline=pipeline)  # works around an LLVM crash
            if schedules is not None and pipeline.schedule_report is not None:
                schedules.update(pipeline.schedule_report)
            return ex
    except BuildError:
        raise
    except Exception as e:
        raise BuildError(
            f"TVM could not build the model for {spec.preset}{' ' + spec.arch if spec.arch else ''}: "
            f"{first_line(e, last=True)}"
        ) from None


def export_library(ex, path: Path, spec: TargetSpec) -> None:
    """Write the executable as a shared library for ``spec`` (cross-linked where the preset says;
    a CUDA library must embed the device binary). Raises :class:`BuildError` in one line."""
    try:
        if spec.cross_compiler:
            from tvm.support import cc

            ex.export_library(str(path), fcompile=cc.cross_compiler(spec.cross_compiler))
        else:
            ex.export_library(str(path))
    except RuntimeError as e:  # tvm.support.cc: "Compilation error:" + the linker's output
        # the linker's complaint, e.g. "/usr/bin/ld: final link failed: No space left on device"
        detail = next((l.strip() for l in str(e).splitlines()[1:] if l.strip()), first_line(e, last=True))
        raise BuildError(
            f"linking the library for {spec.preset} failed: {detail[:300]}; check the C compiler "
            f"({spec.cross_compiler or 'g++'}) and free space in {tempfile.gettempdir()!r}"
        ) from None
    if spec.device == "cuda":
        from .cuda import device_code

        archs = {d["arch"] for d in device_code(path) if d["kind"] == "elf"}
        if spec.arch not in archs:
            raise BuildError(
                f"the CUDA library embeds no {spec.arch} device binary (found {sorted(archs) or 'none'}); "
                "the kernels would need compiling at load time - check nvcc"
            )


def _kernel_count(ex) -> Optional[dict[str, Any]]:
    """Kernel launches and concatenation copies left in the executable (informative only)."""
    try:
        from ..lowering import concat_report

        return concat_report(ex)
    except Exception as e:  # the report must never fail a build
        log.info("no kernel report for this executable: %s", e)
        return None


def program_outputs(mod, names: Sequence[str]) -> list[dict[str, Any]]:
    """``[{"name", "shape", "dtype"}]`` of ``main``'s results, in the model's output order,
    read from the compiled program's types (the topology graph's shapes come from ONNX shape
    inference, which may leave a dim unknown where TVM's import knows it). A result whose
    shape TVM does not know either is a :class:`BuildError`."""
    import tvm
    from tvm import relax

    ret = mod["main"].ret_ty
    fields = list(ret.fields) if isinstance(ret, relax.TupleType) else [ret]
    if len(fields) != len(names):
        raise BuildError(
            f"the compiled program returns {len(fields)} value(s) for the model's {len(names)} output(s) "
            f"{list(names)[:4]}; expected one per output - report the model"
        )
    out = []
    for name, sinfo in zip(names, fields):
        dims = getattr(getattr(sinfo, "shape", None), "values", None)
        if not isinstance(sinfo, relax.TensorType) or dims is None or not all(
            isinstance(d, tvm.tirx.IntImm) for d in dims
        ):
            raise BuildError(
                f"output {name!r} has no static shape in the compiled program ({sinfo}); expected static sizes - "
                "fix every input size with --input-shape"
            )
        out.append({"name": name, "shape": [int(d) for d in dims], "dtype": str(sinfo.dtype)})
    return out


def _manifest(p, spec: TargetSpec, *, fuse: bool, names, report, kernels, model, outputs) -> dict[str, Any]:
    import tvm

    first = p.first

    def io(names_):
        return [
            {"name": n, "shape": [int(d) for d in first.tensor(n).shape], "dtype": first.tensor(n).dtype} for n in names_
        ]

    source = Path(model) if not hasattr(model, "SerializeToString") else None
    return {
        "format": artifact.FORMAT,
        "format_version": artifact.FORMAT_VERSION,
        "created_by": f"tvm_layerfuse {__version__}",
        "tvm_version": tvm.__version__,
        "model": {
            "name": p.model,
            "sha256": artifact.sha256_file(source) if source is not None and source.is_file() else None,
            "notes": p.graph_notes(),  # facts about the model that explain its outputs (run prints them)
        },
        "target": spec.to_dict(),
        "fused": fuse,
        "library": artifact.LIBRARY,
        "params": {"file": artifact.PARAMS, "order": list(names)},
        "inputs": io(first.inputs),
        "outputs": outputs,
        "fusion": {
            "plan": p.counts() if fuse else None,
            "groups": [g.to_dict() for g in p.groups] if fuse else [],
            "refusals": [r.to_dict() for r in p.refusals] if fuse else [],
            "relax": report,
            "kernels": kernels,
        },
    }


