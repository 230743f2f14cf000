"""The command line: ``python -m tvm_layerfuse COMMAND ...``.

Every user mistake ends with one line ``error: ...`` on stderr and exit status 2; an
interrupt ends with status 130. Without a MODEL argument the built-in GoogLeNet
(inception_v1 from the onnx package) is used.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence

from .. import __version__
from ..errors import LayerfuseError, UsageError
from .common import say, verbosity_parent
from .deploy import add_deploy_parser
from .run import add_run_arguments, run_artifact

log = logging.getLogger("tvm_layerfuse")


def parse_input_shapes(items: Sequence[str]) -> dict[str, list[int]]:
    """``["data=1,3,224,224", ...]`` -> ``{"data": [1, 3, 224, 224]}``."""
    shapes: dict[str, list[int]] = {}
    for item in items:
        name, sep, dims = item.rpartition("=")
        if not sep or not name:
            raise UsageError(f"--input-shape {item!r} is malformed; expected NAME=D0,D1,... e.g. data=1,3,224,224")
        try:
            values = [int(d) for d in dims.replace("x", ",").split(",") if d.strip()]
        except ValueError:
            raise UsageError(
                f"--input-shape {item!r} has a non-integer size; expected NAME=D0,D1,... e.g. data=1,3,224,224"
            ) from None
        if not values:
            raise UsageError(f"--input-shape {item!r} gives no sizes; expected NAME=D0,D1,...")
        shapes[name] = values
    return shapes


def _model_arg(value: Optional[str]) -> Path:
    from ..models import default_model

    return Path(value) if value else default_model()


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="ONNX model file (default: the built-in GoogLeNet, inception_v1)")
    p.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="NAME=D0,D1,...",
        help="fix the shape of a graph input (needed when the model declares dynamic sizes); repeatable",
    )


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..planner import plan
    from ..report import plan_text

    model = _model_arg(args.model)
    if (model / "manifest.json").is_file():  # an artifact: its target and the tactic of every conv layer
        return _inspect_artifact(model, args)
    result = plan(model, input_shapes=parse_input_shapes(args.input_shape))
    if args.dot:
        from ..dot import write_dot

        say(args, f"wrote {write_dot(result, Path(args.dot))}")
    if args.svg:
        from ..dot import write_svg

        say(args, f"wrote {write_svg(result, Path(args.svg))}")
    compiled = None
    if args.compile and _is_vta(args):
        from ..compile.vta.pipeline import build, format_report, read_calibration, report
        from ..runtime.vta.config import DEFAULT, load_config

        opts = _vta_options(args)
        calibration = opts["calibration"]
        if calibration is not None:
            calibration = read_calibration(calibration, {n: result.first.tensor(n).shape for n in result.first.inputs},
                                           count=opts["n_calibration"])
        cfg = load_config(opts["config"]) if opts["config"] else DEFAULT
        compiled = report(build(result, cfg=cfg, calibration=calibration, n_calibration=opts["n_calibration"], baseline=True))
        if not args.json:
            sys.stdout.write(plan_text(result, graphs=not args.plan_only) + "\n\n" + format_report(compiled) + "\n")
            return 0
    elif args.compile:
        from ..compile.report import compare

        if args.target != "cpu":
            raise UsageError(f"inspect --compile has no comparison for --target {args.target}; expected cpu or vta - use one of them")

        compiled = compare(model, plan=result, input_shapes=parse_input_shapes(args.input_shape))
    if args.json:
        data = result.to_dict(graphs=not args.plan_only)
        if compiled is not None:
            data["compiled"] = compiled
        json.dump(data, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(plan_text(result, graphs=not args.plan_only) + "\n")
        if compiled is not None:
            from ..compile.report import text

            sys.stdout.write("\n" + text(compiled) + "\n")
    return 0


def _is_vta(args: argparse.Namespace) -> bool:
    """Whether ``--target`` names the VTA preset (or a preset file for a VTA device); VTA
    options with another target are refused."""
    from ..compile.presets import resolve

    vta = args.target == "vta" or (args.target.endswith(".json") and resolve(args.target).device == "vta")
    if not vta:
        for flag, value in (("--vta-config", args.vta_config), ("--calibration", args.calibration)):
            if value is not None:
                raise UsageError(f"{flag} applies to --target vta; found --target {args.target} - drop {flag} or use --target vta")
    return vta


def _vta_options(args: argparse.Namespace) -> dict:
    return {
        "config": args.vta_config,
        "calibration": args.calibration,
        "n_calibration": args.calibration_count,
        "input_shapes": parse_input_shapes(args.input_shape),
    }


def _add_vta_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vta target")
    g.add_argument("--vta-config", metavar="FILE", help="VTA hardware configuration (vta_config.json keys; default targets/vta.json)")
    g.add_argument(
        "--calibration",
        metavar="X.npz",
        help="int8 calibration inputs: one array per model input, [N, *input shape] (default: seeded random inputs)",
    )
    g.add_argument(
        "--calibration-count", type=int, default=8, metavar="N", help="calibration inputs used (or drawn at random), default 8"
    )


def _inspect_artifact(path: Path, args: argparse.Namespace) -> int:
    from ..compile.tactics import format_tactics
    from ..runtime.artifact import read_manifest

    manifest = read_manifest(path)
    target, tactics = manifest["target"], manifest.get("tactics")
    code = _library_code(path, manifest)
    if args.json:
        out = {"target": target, "tactics": tactics, "tuning": manifest.get("tuning"), "schedules": manifest.get("schedules"), "code": code}
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    tvm_target = target.get("tvm_target") or {}
    portable = "portable" if target.get("portable", True) else "this CPU only: " + ", ".join(target.get("cpu_flags") or [])
    sys.stdout.write(f"artifact {path}: target {target.get('preset')} ({tvm_target.get('mcpu', 'generic')}, {portable})\n")
    sys.stdout.write(format_tactics(tactics) + "\n")
    tuning = manifest.get("tuning")
    sys.stdout.write(
        f"tuning: {tuning['records']} records for {tuning['workloads']} kernels from {tuning['database']}\n"
        if tuning
        else "tuning: none (TVM's kernels as scheduled by default; `tune` writes a database that compile applies)\n"
    )
    from ..compile.schedules.report import format_schedules

    sys.stdout.write(format_schedules(manifest.get("schedules"), code) + "\n")
    return 0


def _library_code(path: Path, manifest: dict) -> Optional[dict]:
    """Per kernel of a CPU artifact's library: parallel launch and vector FMAs, from its
    disassembly (None for an artifact without a schedule report)."""
    from ..compile.schedules.disassembly import library_code

    schedules = manifest.get("schedules")
    if not schedules or manifest["target"].get("device") != "cpu":
        return None
    return library_code(path / manifest["library"], manifest["target"]["machine"], schedules.get("kernels", {}))


def cmd_tune(args: argparse.Namespace) -> int:
    from ..compile.tune import tune_model

    result = tune_model(
        _model_arg(args.model),
        target=args.target,
        arch=args.arch,
        trials=args.trials,
        budget=args.budget,
        tactics=args.tactics,
        input_shapes=parse_input_shapes(args.input_shape),
        rpc=args.rpc,
        tracker=args.tracker,
        key=args.key,
        progress=not getattr(args, "quiet", False) and sys.stderr.isatty(),
    )
    say(args, f"tuned {result.tasks} kernels, {result.trials} trials in {result.seconds:.0f} s; database {result.database}")
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from ..compile.build import compile_model

    model = _model_arg(args.model)
    if _is_vta(args):
        return _compile_vta(args, model)
    out = Path(args.output) if args.output else Path(f"{model.stem}.{args.target}{'.' + args.arch if args.arch else ''}")
    compile_model(
        model,
        out,
        on_commit=args.interrupts.done,  # from the artifact's rename on, the command is done
        target=args.target,
        arch=args.arch,
        fuse=not args.no_fuse,
        input_shapes=parse_input_shapes(args.input_shape),
        force=args.force,
        progress=not args.quiet and sys.stderr.isatty(),
        tactics=args.tactics,
        winograd=args.winograd,
    )
    say(args, f"wrote artifact {out}")
    if not args.quiet:
        from ..runtime.artifact import read_manifest

        manifest = read_manifest(out)
        fusion = manifest["fusion"]
        tactics = manifest.get("tactics") or {}
        if tactics.get("counts"):
            print("tactics: " + ", ".join(f"{k} {v} layers" for k, v in sorted(tactics["counts"].items())))
        tuning = manifest.get("tuning")
        if tuning:
            print(f"tuned kernels: {tuning['records']} records for {tuning['workloads']} kernels from {tuning['database']}")
        if fusion.get("plan"):
            c = fusion["plan"]
            print(
                f"merged: {c['vertical']} vertical, {c['horizontal']} horizontal, {c['eltwise']} element-wise, "
                f"{c['concat_in_place']} in-place concat; {c['layers_first']} layers -> {c['kernels_second']} kernels planned"
            )
        kernels = fusion.get("kernels")
        if kernels:
            print(
                f"kernel launches per inference: {kernels['kernels']}; concatenate copies left: "
                f"{kernels['concat_kernels']} ({kernels['concat_bytes_copied']} bytes)"
            )
        from ..planner import CONSTANT_FILL_NOTE

        for note in manifest["model"].get("notes", []):
            if note.startswith(CONSTANT_FILL_NOTE):
                print(f"note: {note}")
    return 0


def _compile_vta(args: argparse.Namespace, model: Path) -> int:
    from ..compile.vta.pipeline import compile_vta, format_report

    if args.no_fuse or args.arch:
        raise UsageError(
            f"{'--no-fuse' if args.no_fuse else '--arch'} does not apply to --target vta; drop it "
            "(the vta report compares fused and unfused programs itself)"
        )
    if args.calibration_count < 1:
        raise UsageError(
            f"--calibration-count {args.calibration_count} is not positive; expected N >= 1 - give how many inputs to calibrate on, e.g. 8"
        )
    out = Path(args.output) if args.output else Path(f"{model.stem}.vta")
    rep = compile_vta(model, out, force=args.force, on_commit=args.interrupts.done, target=args.target, **_vta_options(args))
    say(args, f"wrote artifact {out}")
    if not args.quiet:
        print(format_report(rep))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    return run_artifact(args, Path(args.artifact), say=lambda m: say(args, m))


def cmd_bundle(args: argparse.Namespace) -> int:
    from ..deploy.bundle import make_bundle, size_of

    out = make_bundle(Path(args.artifact), Path(args.output), python=args.python, force=args.force)
    sizes = size_of(out)
    say(
        args,
        f"wrote bundle {out}: runtime {sizes['runtime_bytes'] / 2**20:.1f} MiB + weights "
        f"{sizes['weights_bytes'] / 2**20:.1f} MiB"
        + (f" + oneDNN {sizes['vendor_bytes'] / 2**20:.1f} MiB" if sizes["vendor_bytes"] else "")
        + f"; run it with: python3 {out}/run.py",
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tvm_layerfuse",
        description="Layer fusion for CNNs on Apache TVM: inspect, plan and compile ONNX models.",
    )
    parser.add_argument("--version", action="version", version=f"tvm_layerfuse {__version__}")
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="store_true", help="more log output (and tracebacks of internal errors)")
    verbosity.add_argument("-q", "--quiet", action="store_true", help="only errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "inspect",
        parents=[verbosity_parent()],
        help="show the topology graph, the fusion plan and the fused graph (of an artifact directory: its target "
        "and the tactic of every conv layer)",
    )
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="print the plan and both graphs as JSON")
    p.add_argument("--plan-only", action="store_true", help="leave the two graph tables (or JSON graphs) out")
    p.add_argument("--dot", metavar="FILE", help="write both graphs side by side as Graphviz DOT")
    p.add_argument("--svg", metavar="FILE", help="draw both graphs side by side as SVG (needs Graphviz's dot)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also lower the model for CPU with TVM's default pipeline and with layerfuse, and compare kernels and bytes "
        "(with --target vta: layer placement, VTA instructions and DRAM bytes, fused vs unfused)",
    )
    p.add_argument("--target", default="cpu", help="with --compile: cpu (default) or vta")
    _add_vta_args(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("compile", parents=[verbosity_parent()], help="compile a model into a device-executable artifact")
    _add_model_args(p)
    p.add_argument("--target", default="cpu", help="target preset (cpu, aarch64, cuda, vta) or a preset JSON file")
    p.add_argument("--arch", help="GPU architecture for --target cuda: sm_80, sm_87 (Jetson Orin), sm_90, ...")
    p.add_argument("-o", "--output", metavar="DIR", help="artifact directory (default MODEL.TARGET[.ARCH])")
    p.add_argument("--no-fuse", action="store_true", help="build with TVM's default pipeline only, for comparison")
    p.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    _add_vta_args(p)
    p.add_argument(
        "--tactics",
        choices=("auto", "onednn", "tvm"),
        default="auto",
        help="conv implementation: oneDNN where installed (auto), oneDNN or fail, or TVM's kernels only",
    )
    p.add_argument(
        "--winograd",
        choices=("timed", "never", "always"),
        default="timed",
        help="oneDNN 3x3 convs: time direct and Winograd per layer and keep the faster (timed), direct only "
        "(never: the same kernels on every compile), or Winograd wherever oneDNN has it",
    )
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser(
        "tune", parents=[verbosity_parent()], help="MetaSchedule-tune the kernels that stay with TVM (database per target)"
    )
    _add_model_args(p)
    p.add_argument("--target", default="cpu", help="target preset (cpu, cpu-portable, aarch64, cuda) or a preset JSON file")
    p.add_argument("--arch", help="GPU architecture for --target cuda")
    p.add_argument("--trials", type=int, default=256, help="measurements in all (default 256)")
    p.add_argument("--budget", type=float, metavar="SECONDS", help="stop the search after this many seconds")
    p.add_argument("--tactics", choices=("auto", "onednn", "tvm"), default="auto", help="as for compile")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--rpc", metavar="HOST:PORT", help="measure on a board through TVM's RPC runner (its tracker)")
    where.add_argument("--tracker", metavar="HOST:PORT", help="measure on the boards of an RPC tracker")
    p.add_argument("--key", help="device key of the boards (with --rpc/--tracker)")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("run", parents=[verbosity_parent()], help="run an artifact on inputs with the TVM runtime")
    p.add_argument("artifact", help="artifact directory written by compile")
    add_run_arguments(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bundle", parents=[verbosity_parent()], help="a runtime-only directory for a machine without TVM")
    p.add_argument("artifact", help="artifact directory written by compile")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="bundle directory to create")
    p.add_argument("--python", help="Python MAJOR.MINOR of the target machine (default: this one)")
    p.add_argument("--force", action="store_true", help="replace an existing bundle directory")
    p.set_defaults(func=cmd_bundle)

    add_deploy_parser(sub, parents=[verbosity_parent()])
    return parser


INTERRUPTED = "error: interrupted; nothing was written"


def _say_interrupted(*, standalone: bool) -> None:
    """The one error line of an interrupt, on the terminal even when the interrupt came while
    native output was redirected (see :mod:`tvm_layerfuse.native_output`). ``standalone`` (the
    process ends with the command): nothing is printed after it -- an object the interrupt cut
    short in its constructor (TVM's ``TempDirectory`` while the library is exported) would
    otherwise print "Exception ignored in ... __del__" and a traceback as it is freed."""
    from .. import native_output

    native_output.restore()
    from ..runtime.artifact import remove_unfinished

    remove_unfinished()  # "nothing was written": also where Ctrl-C cut a clean-up short
    print(INTERRUPTED, file=sys.stderr)
    if standalone:
        sys.stderr.flush()
        sys.unraisablehook = lambda unraisable: None


class Interrupts:
    """SIGINT while a command runs: recorded and raised as ``KeyboardInterrupt`` until the
    command's result is in place (:meth:`done`), ignored from then on.

    So one Ctrl-C at any instant ends either with nothing written, ``error: interrupted;
    nothing was written`` and status 130, or with the complete result and status 0.
    """

    def __init__(self, *, ignore_when_done: bool = False) -> None:
        self.seen: list[int] = []
        self.finished = False
        self.ignore_when_done = ignore_when_done

    def __call__(self, signum, frame) -> None:
        if self.finished:
            return
        if _importing(frame):
            # Raised while an extension module initialises (onnx's, TVM's), the interrupt
            # would abort the process: C++ cannot unwind it. It comes again after the import.
            self._again()
            return
        self.seen.append(signum)
        signal.default_int_handler(signum, frame)

    def _again(self) -> None:
        main = threading.main_thread().ident
        timer = threading.Timer(0.02, lambda: signal.pthread_kill(main, signal.SIGINT))
        timer.daemon = True
        timer.start()

    def done(self) -> None:
        """The result is in place: later interrupts change nothing. With ``ignore_when_done``
        (the process is the command) SIGINT is ignored from here to the process's end: Python
        resets its handlers to the default (death by the signal) while it shuts down."""
        self.finished = True
        if self.ignore_when_done and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _importing(frame) -> bool:
    """Whether ``frame`` runs inside an import (importlib's frames are on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _watch_interrupts(*, keep: bool = False):
    """:class:`Interrupts` as the SIGINT handler while the command runs (``keep``: and after,
    for ``python -m tvm_layerfuse``, whose process ends with the command)."""
    interrupts = Interrupts(ignore_when_done=keep)
    previous = signal.getsignal(signal.SIGINT)
    # Only Python's own handler is replaced: an ignored SIGINT stays ignored, and signal
    # handlers can only be set from the main thread.
    if previous is not signal.default_int_handler or threading.current_thread() is not threading.main_thread():
        yield interrupts
        return
    signal.signal(signal.SIGINT, interrupts)
    try:
        yield interrupts
    finally:
        interrupts.done()
        if not keep:
            signal.signal(signal.SIGINT, previous)


def main(argv: Optional[Sequence[str]] = None, *, standalone: bool = False) -> int:
    """Run the command line; returns the exit status. ``standalone``: this process is the
    command (``python -m tvm_layerfuse``): interrupts stay handled until it exits."""
    with _watch_interrupts(keep=standalone) as interrupts:
        try:
            return _main(argv, interrupts)
        except KeyboardInterrupt:  # Ctrl-C before the command started (imports, argument parsing)
            _say_interrupted(standalone=standalone)
            return 130


def _main(argv: Optional[Sequence[str]], interrupts: Interrupts) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.ERROR if args.quiet else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s: %(message)s", stream=sys.stderr)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    args.interrupts = interrupts
    return _run(args, interrupts.seen, standalone=interrupts.ignore_when_done)


def _run(args: argparse.Namespace, interrupts: list[int], *, standalone: bool = False) -> int:
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        _say_interrupted(standalone=standalone)
        return 130
    except Exception as e:
        if interrupts:
            # Ctrl-C inside a Python callback that TVM called from C++ (our Relax passes)
            # comes back out of TVM's FFI as a RuntimeError, or wrapped in our BuildError.
            _say_interrupted(standalone=standalone)
            return 130
        if isinstance(e, LayerfuseError):
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code
        if isinstance(e, BrokenPipeError):
            return 0
        # an internal error, not the user's: say so in one line unless --verbose
        if args.verbose:
            raise
        print(
            f"internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
            "(run with --verbose for the traceback, and please report it)",
            file=sys.stderr,
        )
        return 3
