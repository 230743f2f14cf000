"""Latency of compiled artifacts against onnxruntime and OpenVINO, each engine in its own process.

Usage: python scripts/bench_models.py MODEL.onnx [MODEL.onnx ...] [--threads 2 1] [--rounds 3]
                                      [--runs 30] [--work DIR] [--no-fusion-off] [--tactics tvm]

The bench's twelve torchvision networks, with seeded live weights, come from
``python scripts/export_torchvision.py models/`` (needs torch and torchvision).

For each model (batch 1, float32, the ONNX file as given):

1. ``compile`` it with the defaults (fusion and the tactic choice; ``--tactics tvm``: TVM's
   kernels only) and with ``--no-fuse``
   (the same tactics on the unfused model: the "fusion off / on" column); the artifacts are
   kept under ``--work`` and reused while the model file and this package do not change;
2. check the artifact's outputs against onnxruntime with graph optimisations off on one seeded
   input (the largest relative error over all outputs);
3. time each engine in a process of its own, started fresh for every round, with ``THREADS``
   intra-op threads (``OMP_NUM_THREADS``/``TVM_NUM_THREADS`` for layerfuse; onnxruntime's
   ``intra_op_num_threads`` with all graph optimisations; OpenVINO's CPU plugin with the
   LATENCY hint, f32 inference precision and ``INFERENCE_NUM_THREADS``). The engines take
   turns: round 1 runs layerfuse, fusion-off, onnxruntime, OpenVINO, round 2 the same again,
   so that a change in the machine's load falls on every engine alike. Each process warms up,
   then times ``--runs`` single inferences; it reports their median. The table gives, per
   engine, the median over the rounds. Every engine gets the same seeded input arrays, 64-byte
   aligned (``runtime.aligned``): onnxruntime reads a NumPy input where it lies whatever its
   alignment, layerfuse where it is so aligned (else it copies it first, about 0.1 ms at
   224x224x3), OpenVINO copies it into its own tensor either way.

The load average is printed before and after: a table measured beside other work (tests,
fuzzing, tuning) is not a result. So is the share of CPU time the hypervisor took from this
machine while the engines ran (``steal`` in ``/proc/stat``, on a virtual machine), and each
engine's spread over the rounds (the lowest and highest round median, in brackets): on a
virtual machine whose host is busy the same engine's rounds can differ by tens of percent, and
a ratio within that spread is a tie. The column "against the faster" says so per model
(:func:`verdict`): layerfuse's median over the faster engine's (the one of onnxruntime and
OpenVINO with the lower median), then ``ahead`` where every round of layerfuse beat every round
of that engine, ``behind`` where every one lost, ``tie`` where the two spreads overlap (more
rounds may separate them). OpenVINO is optional (``pip install -e ".[bench]"``); without
it its column is empty.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ENGINES = ("layerfuse", "fusion-off", "onnxruntime", "openvino")


# ---------------------------------------------------------------------- one engine, one process
def _feeds(path: str) -> dict:
    import onnx

    from tvm_layerfuse.runtime import aligned
    from tvm_layerfuse.testing import random_inputs

    return {name: aligned(x) for name, x in random_inputs(onnx.load(path, load_external_data=False), 0).items()}


def _time(run, runs: int) -> float:
    for _ in range(max(3, runs // 10)):
        run()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def worker(engine: str, model: str, artifact: str, threads: int, runs: int) -> float:
    feeds = _feeds(model)
    if engine in ("layerfuse", "fusion-off"):
        from tvm_layerfuse.runtime import load

        rt = load(artifact)
        return _time(lambda: rt.run(feeds), runs)
    if engine == "onnxruntime":
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        return _time(lambda: sess.run(None, feeds), runs)
    if engine == "openvino":
        import openvino as ov

        core = ov.Core()
        config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"}
        compiled = core.compile_model(model, "CPU", config)
        request = compiled.create_infer_request()
        return _time(lambda: request.infer(feeds), runs)
    raise SystemExit(f"unknown engine {engine!r}")


# ---------------------------------------------------------------------- the driver
def verdict(ours: list[float], theirs: list[float]) -> str:
    """``ahead`` where each of ``ours`` (round medians, ms) is below each of ``theirs``,
    ``behind`` where each is above, else ``tie``: the spreads overlap."""
    if max(ours) < min(theirs):
        return "ahead"
    if min(ours) > max(theirs):
        return "behind"
    return "tie"


def against_faster(ours: list[float], anchors: dict[str, list[float]]) -> str:
    """layerfuse's median over the faster anchor's (the lower median of ``anchors``: engine ->
    round medians) and the :func:`verdict` against that anchor's rounds, e.g. ``0.94 ahead``."""
    theirs = min(anchors.values(), key=statistics.median)
    return f"{statistics.median(ours) / statistics.median(theirs):.2f} {verdict(ours, theirs)}"


def _has_openvino() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def _stamp(model: Path) -> str:
    """The model file's digest and the package's (its sources), as the artifact's name for them."""
    import tvm_layerfuse

    package = Path(tvm_layerfuse.__file__).parent
    h = hashlib.sha256()
    for f in sorted(package.rglob("*.py")) + sorted(package.rglob("*.cc")) + sorted(package.rglob("*.inc")):
        h.update(f.read_bytes())
    return f"model {hashlib.sha256(model.read_bytes()).hexdigest()[:12]} package {h.hexdigest()[:12]}"


def _cpu_ticks() -> tuple[int, int]:
    """(all CPU ticks, stolen ticks) since boot, from ``/proc/stat`` ((0, 0) where there is none)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0


def compile_pair(model: Path, work: Path, *, fusion_off: bool, reuse: bool, tactics: str = "auto") -> dict[str, Path]:
    """The artifacts (fused, and unfused with ``fusion_off``), compiled once per model and
    package with ``--tactics tactics``; ``reuse``: those already under ``work`` for this model
    file, whatever package made them."""
    stamp = _stamp(model) + ("" if tactics == "auto" else f" tactics {tactics}")
    out = {}
    for engine, extra in (("layerfuse", []), ("fusion-off", ["--no-fuse"])):
        extra = [*extra, "--tactics", tactics]
        if engine == "fusion-off" and not fusion_off:
            continue
        art = work / f"{model.stem}.{engine}"
        made = (art / "stamp").read_text() if (art / "stamp").is_file() else ""
        same_model = made.split(" package")[0] == stamp.split(" package")[0]
        if reuse and same_model and (made.partition(" tactics ")[2] or "auto") == tactics:
            print(f"{art}: reused ({made})")
        elif made != stamp:
            cmd = [sys.executable, "-m", "tvm_layerfuse", "compile", str(model), "-o", str(art), "--force", *extra]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            (art / "stamp").write_text(stamp)
        out[engine] = art
    return out


def max_rel_err(model: Path, art: Path) -> float:
    import numpy as np
    import onnx

    from tvm_layerfuse.runtime import load
    from tvm_layerfuse.testing import run_onnxruntime

    feeds = _feeds(str(model))
    got = load(art).run(feeds)
    expected = run_onnxruntime(onnx.load(str(model)), feeds)  # graph optimisations off
    return max(float(np.max(np.abs(np.asarray(g) - e)) / max(float(np.max(np.abs(e))), 1e-12)) for e, g in zip(expected, got.values()))


def measure(engine: str, model: Path, art: Path | None, threads: int, runs: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TVM_NUM_THREADS=str(threads))
    cmd = [sys.executable, __file__, "--worker", engine, str(model), str(art or ""), str(threads), str(runs)]
    res = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return float(json.loads(res.stdout.strip().splitlines()[-1])["median_ms"])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        engine, model, artifact, threads, runs = sys.argv[2:7]
        ms = worker(engine, model, artifact, int(threads), int(runs))
        print(json.dumps({"median_ms": ms}))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--work", type=Path, default=Path("bench_work"))
    ap.add_argument("--no-fusion-off", action="store_true", help="skip the unfused artifact (its column stays empty)")
    ap.add_argument("--compile-only", action="store_true", help="compile the artifacts and stop (no timing)")
    ap.add_argument("--reuse", action="store_true", help="time the artifacts already under --work for these model files")
    ap.add_argument("--tactics", default="auto", choices=["auto", "onednn", "tvm"], help="compile's --tactics (tvm: TVM's kernels only)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    engines = [e for e in ENGINES if (e != "openvino" or _has_openvino()) and (e != "fusion-off" or not args.no_fusion_off)]
    arts, errs = {}, {}
    for model in args.models:
        arts[model] = compile_pair(model, args.work, fusion_off=not args.no_fusion_off, reuse=args.reuse, tactics=args.tactics)
        errs[model] = max_rel_err(model, arts[model]["layerfuse"])
    if args.compile_only:
        return
    print(f"load average before timing: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  ({os.cpu_count()} CPUs)")
    cmd = "python scripts/bench_models.py " + " ".join(sys.argv[1:])
    ticks = _cpu_ticks()
    for threads in args.threads:
        times: dict[tuple, list[float]] = {}
        for _ in range(args.rounds):
            for model in args.models:
                for engine in engines:
                    ms = measure(engine, model, arts[model].get(engine), threads, args.runs)
                    times.setdefault((model, engine), []).append(ms)
        print(f"\n{threads} thread(s), median of {args.rounds} rounds x {args.runs} runs, ms   ({cmd})")
        print(
            "| model | layerfuse | onnxruntime | OpenVINO | layerfuse / onnxruntime | layerfuse / OpenVINO "
            "| against the faster | fusion off / on | max rel. err |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for model in args.models:
            med = {e: statistics.median(times[(model, e)]) for e in engines}
            spread = {e: f" ({min(times[(model, e)]):.2f}-{max(times[(model, e)]):.2f})" if args.rounds > 1 else "" for e in engines}
            lf = med["layerfuse"]
            ov = med.get("openvino")
            off = med.get("fusion-off")
            anchors = {e: times[(model, e)] for e in ("onnxruntime", "openvino") if e in med}
            against = against_faster(times[(model, "layerfuse")], anchors)
            print(
                f"| {model.stem} | {lf:.2f}{spread['layerfuse']} | {med['onnxruntime']:.2f}{spread['onnxruntime']} | "
                f"{f'{ov:.2f}' + spread['openvino'] if ov else '-'} | "
                f"{lf / med['onnxruntime']:.2f} | {f'{lf / ov:.2f}' if ov else '-'} | {against} | "
                f"{f'{off / lf:.2f}' if off else '-'} | {errs[model]:.1e} |"
            )
    total, stolen = (b - a for a, b in zip(ticks, _cpu_ticks()))
    print(f"\nload average after timing: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
          + (f"; CPU time stolen by the hypervisor while timing: {100 * stolen / total:.1f} %" if total else ""))


if __name__ == "__main__":
    main()
