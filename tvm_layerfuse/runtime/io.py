"""The inference side of the command line: inputs from files, results printed or stored.

Shared by ``python -m tvm_layerfuse run`` and a bundle's ``run.py``; it needs only numpy,
the TVM runtime and (for image inputs) Pillow.

Inputs, one ``--input`` per model input (or one file holding them all):

* ``x.npy``: the array for the model's only input, or ``NAME=x.npy`` for one of several;
* ``x.npz``: arrays named after the model's inputs (``arr_0`` for a single input);
* ``image.png`` / ``.jpg``: resized to the input's H×W, RGB, scaled to [0, 1] and
  normalised with ``--mean``/``--std`` (ImageNet's by default), NCHW;
* nothing: a seeded standard-normal array per input (``--seed``), for smoke tests.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ..errors import InputError, LayerfuseError, UsageError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".webp"}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def load_inputs(
    specs: Sequence[dict[str, Any]],
    items: Sequence[str],
    *,
    seed: int = 0,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> dict[str, np.ndarray]:
    """Arrays for the model inputs described by ``specs`` from ``--input`` items."""
    names = [s["name"] for s in specs]
    by_name = {s["name"]: s for s in specs}
    if not items:
        rng = np.random.default_rng(seed)
        return {s["name"]: rng.standard_normal(s["shape"]).astype(s["dtype"]) for s in specs}
    values: dict[str, np.ndarray] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or name not in by_name and Path(item).exists():
            name, path = None, item
        p = Path(path)
        if not p.is_file():
            raise InputError(f"input file {path!r} does not exist or is not a file; give a .npy, .npz or image path")
        suffix = p.suffix.lower()
        if suffix == ".npz":
            values.update(_from_npz(p, names))
            continue
        target = name or (names[0] if len(names) == 1 else None)
        if target is None:
            raise InputError(
                f"input file {path!r} does not say which input it is; the model has {names} - "
                f"write NAME={path} or use one .npz with all of them"
            )
        if suffix == ".npy":
            values[target] = _from_npy(p)
        elif suffix in IMAGE_SUFFIXES:
            values[target] = _from_image(p, by_name[target], mean=mean, std=std)
        else:
            raise InputError(f"input file {path!r} has suffix {suffix or '(none)'}; expected .npy, .npz or an image")
    missing = [n for n in names if n not in values]
    if missing:
        raise InputError(f"no value for input {missing[0]!r}; the model needs {names}")
    return values


def _from_npy(p: Path) -> np.ndarray:
    try:
        return np.load(p, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise InputError(f"input file {str(p)!r} is not a readable .npy array ({e}); save it with numpy.save") from None


def _from_npz(p: Path, names: list[str]) -> dict[str, np.ndarray]:
    try:
        with np.load(p, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (ValueError, OSError) as e:
        raise InputError(f"input file {str(p)!r} is not a readable .npz archive ({e}); save it with numpy.savez") from None
    if len(names) == 1 and list(arrays) == ["arr_0"]:
        return {names[0]: arrays["arr_0"]}
    unknown = [k for k in arrays if k not in names]
    if unknown:
        raise InputError(f"{str(p)!r} holds {unknown[0]!r}, which is not a model input; expected names among {names}")
    return arrays


def _from_image(p: Path, spec: dict[str, Any], *, mean, std) -> np.ndarray:
    try:
        from PIL import Image
    except ImportError:
        raise UsageError("image inputs need Pillow; install it (pip install pillow) or pass a .npy array") from None
    shape = spec["shape"]
    if len(shape) != 4 or shape[1] not in (1, 3):
        raise InputError(f"input {spec['name']!r} has shape {shape}; images need an NCHW input with 1 or 3 channels")
    try:
        img = Image.open(p)
        img = img.convert("RGB" if shape[1] == 3 else "L").resize((shape[3], shape[2]), Image.BILINEAR)
    except OSError as e:
        raise InputError(f"input image {str(p)!r} cannot be read ({e}); give a PNG or JPEG file") from None
    x = np.asarray(img, dtype=np.float32) / 255.0  # [H, W, C] or [H, W]
    x = x.reshape(shape[2], shape[3], -1).transpose(2, 0, 1)  # [C, H, W]
    c = shape[1]
    x = (x - np.asarray(mean[:c], np.float32).reshape(c, 1, 1)) / np.asarray(std[:c], np.float32).reshape(c, 1, 1)
    return np.broadcast_to(x, shape).astype(spec["dtype"])


def summarize(outputs: dict[str, np.ndarray], *, top: int = 5) -> str:
    """Shapes and value ranges; for a classifier output, the top-k classes of each sample."""
    lines = []
    for name, y in outputs.items():
        lines.append(f"{name}: shape {list(y.shape)} {y.dtype}, min {y.min():.6g}, max {y.max():.6g}")
        flat = y.reshape(y.shape[0], -1) if y.ndim >= 2 else None
        if flat is not None and 2 <= flat.shape[1] and int(np.prod(y.shape[1:])) == max(y.shape[1:]):
            for n, row in enumerate(flat):
                best = np.argsort(-row, kind="stable")[:top]
                ranked = ", ".join(f"{int(i)}: {row[i]:.4f}" for i in best)
                lines.append(f"  sample {n} top-{len(best)}: {ranked}")
    return "\n".join(lines)


def save_outputs(path: Path, outputs: dict[str, np.ndarray]) -> None:
    """Write ``outputs`` to ``path`` (.npz) atomically: all or nothing."""
    path = Path(path)
    if path.suffix != ".npz":
        raise UsageError(f"--output {str(path)!r} must end in .npz")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"output directory {str(parent)!r} does not exist; create it or choose another --output")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".npz", dir=parent)
    except OSError as e:
        raise UsageError(f"cannot write {str(path)!r} ({e.strerror}); choose a writable --output") from None
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **outputs)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", action="append", default=[], metavar="FILE|NAME=FILE", help=".npy, .npz or image; repeatable")
    p.add_argument("--output", metavar="Y.npz", help="store the outputs (atomically) instead of only printing them")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random input used when --input is not given")
    p.add_argument("--top", type=int, default=5, help="classes shown per sample for classifier outputs")
    p.add_argument("--mean", type=float, nargs=3, default=IMAGENET_MEAN, metavar=("R", "G", "B"))
    p.add_argument("--std", type=float, nargs=3, default=IMAGENET_STD, metavar=("R", "G", "B"))
    p.add_argument("--benchmark", type=int, default=0, metavar="N", help="also time N runs (median/min/max)")


def run_artifact(args: argparse.Namespace, artifact_dir: Path, *, say=print) -> int:
    from .loader import load

    rt = load(artifact_dir, device=args.device)
    inputs = load_inputs(rt.inputs, args.input, seed=args.seed, mean=args.mean, std=args.std)
    outputs = rt.run(inputs)
    if args.output:
        save_outputs(Path(args.output), outputs)
        say(f"wrote {args.output}")
    print(summarize(outputs, top=args.top))
    if args.benchmark:
        t = rt.benchmark(inputs, repeat=args.benchmark)
        print(f"latency over {t['repeat']} runs: median {t['median_ms']:.3f} ms (min {t['min_ms']:.3f}, max {t['max_ms']:.3f})")
    return 0


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
