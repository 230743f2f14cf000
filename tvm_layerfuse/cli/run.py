"""``run``: an artifact on inputs from files, results printed or stored.

Shared by ``python -m tvm_layerfuse run`` and a bundle's ``run.py``: it imports only the
runtime package (numpy, the TVM runtime, Pillow for images), never the compiler.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..errors import LayerfuseError
from ..runtime.io import IMAGENET_MEAN, IMAGENET_STD, check_output_path, read_inputs, summarize, write_outputs


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", action="append", default=[], metavar="FILE|NAME=FILE", help=".npy, .npz or image; repeatable")
    p.add_argument("--output", metavar="Y.npz", help="store the outputs (atomically) instead of only printing them")
    p.add_argument(
        "--device", help="cpu, cuda or cuda:N (default cpu); for a vta artifact sim (default: the simulator, hardware mode), "
        "sim-functional (upstream's functional simulator, for comparison) or board"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random input used when --input is not given")
    p.add_argument("--top", type=int, default=5, help="classes shown per sample for classifier outputs")
    p.add_argument("--mean", type=float, nargs=3, default=IMAGENET_MEAN, metavar=("R", "G", "B"))
    p.add_argument("--std", type=float, nargs=3, default=IMAGENET_STD, metavar=("R", "G", "B"))
    p.add_argument(
        "--benchmark",
        type=int,
        default=0,
        metavar="N",
        help="also time N runs (median/min/max); with --compare, N interleaved rounds of both artifacts and their ratio",
    )
    p.add_argument(
        "--compare",
        metavar="ARTIFACT",
        help="also run this artifact (e.g. the --no-fuse build of the same model) on the same inputs and "
        "print how far its outputs are from these",
    )


def run_artifact(args: argparse.Namespace, artifact_dir: Path, *, say=print) -> int:
    from ..runtime import load

    if args.output:
        check_output_path(args.output)  # before any work: nothing is run for a bad --output
    rt = load(artifact_dir, device=args.device)
    inputs = read_inputs(rt.inputs, args.input, seed=args.seed, mean=args.mean, std=args.std)
    outputs = rt.run(inputs)
    if args.output:
        write_outputs(args.output, outputs)
        say(f"wrote {args.output}")
    print(summarize(outputs, top=args.top))
    counters = getattr(rt, "counters", None)  # a VTA artifact: the accelerator's profiling counters
    if counters:
        print("VTA counters: " + ", ".join(f"{k} {v}" for k, v in counters.items()))
    other = load(Path(args.compare), device=args.device) if getattr(args, "compare", None) else None
    if other is not None:
        print(compare_text(outputs, other.run(inputs), other=args.compare))
    for note in rt.manifest.get("model", {}).get("notes", []):
        if note.startswith("weights are constant fills"):  # explains a flat top-5 where it is printed
            print(f"note: {note}")
    if args.benchmark and other is not None:
        print(benchmark_pair_text(rt, other, inputs, rounds=args.benchmark, other=args.compare))
    elif args.benchmark:
        t = rt.benchmark(inputs, repeat=args.benchmark)
        print(f"latency over {t['repeat']} runs: median {t['median_ms']:.3f} ms (min {t['min_ms']:.3f}, max {t['max_ms']:.3f})")
    return 0


def benchmark_pair_text(rt, other_rt, inputs: dict, *, rounds: int, other: str) -> str:
    """Both artifacts timed in one process on the same inputs, one run of each per round
    (interleaved, so a change in the machine's load reaches both sides alike): medians,
    spreads and the ratio."""
    import statistics

    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(rounds):
        ours.append(rt.benchmark(inputs, repeat=1)["median_ms"])
        theirs.append(other_rt.benchmark(inputs, repeat=1)["median_ms"])
    a, b = statistics.median(ours), statistics.median(theirs)
    return (
        f"latency over {rounds} interleaved rounds: median {a:.3f} ms (min {min(ours):.3f}, max {max(ours):.3f}); "
        f"{other}: median {b:.3f} ms (min {min(theirs):.3f}, max {max(theirs):.3f}); {other} / this = {b / a:.2f}"
    )


def compare_text(outputs: dict, others: dict, *, other: str) -> str:
    """One line per output: the largest difference from the other artifact's output,
    absolute and relative to the largest magnitude (fp32 builds of one model agree to ~1e-6)."""
    import numpy as np

    lines = []
    for name, y in outputs.items():
        z = others.get(name)
        if z is None or z.shape != y.shape:
            lines.append(f"{name}: {other} has no output of shape {list(y.shape)} under this name")
            continue
        diff = float(np.max(np.abs(y.astype(np.float64) - z))) if y.size else 0.0
        rel = diff / max(float(np.max(np.abs(y))) if y.size else 0.0, 1e-30)
        lines.append(f"{name}: {other} agrees on these inputs: max |diff| {diff:.3g}, relative {rel:.3g}")
    return "\n".join(lines)


def bundle_main(argv: Optional[Sequence[str]] = None, *, artifact_dir: Path) -> int:
    """Entry point of a bundle's ``run.py``."""
    parser = argparse.ArgumentParser(prog="run.py", description="Run the bundled model with the TVM runtime only.")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_artifact(args, artifact_dir, say=lambda m: print(m, file=sys.stderr))
    except LayerfuseError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
