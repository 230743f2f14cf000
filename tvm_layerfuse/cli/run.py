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
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random input used when --input is not given")
    p.add_argument("--top", type=int, default=5, help="classes shown per sample for classifier outputs")
    p.add_argument("--mean", type=float, nargs=3, default=IMAGENET_MEAN, metavar=("R", "G", "B"))
    p.add_argument("--std", type=float, nargs=3, default=IMAGENET_STD, metavar=("R", "G", "B"))
    p.add_argument("--benchmark", type=int, default=0, metavar="N", help="also time N runs (median/min/max)")
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
    if getattr(args, "compare", None):
        print(compare_text(outputs, load(Path(args.compare), device=args.device).run(inputs), other=args.compare))
    for note in rt.manifest.get("model", {}).get("notes", []):
        if note.startswith("weights are constant fills"):  # explains a flat top-5 where it is printed
            print(f"note: {note}")
    if args.benchmark:
        t = rt.benchmark(inputs, repeat=args.benchmark)
        print(f"latency over {t['repeat']} runs: median {t['median_ms']:.3f} ms (min {t['min_ms']:.3f}, max {t['max_ms']:.3f})")
    return 0


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
