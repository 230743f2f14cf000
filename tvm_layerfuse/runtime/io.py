"""Input files in, output files out: shared by ``run``, ``deploy`` and a bundle's ``run.py``.

It needs only numpy (and Pillow for image inputs). Inputs, one item per model input (or
one file holding them all):

* ``x.npy``: the array for the model's only input, or ``NAME=x.npy`` for one of several;
* ``x.npz``: arrays named after the model's inputs (any one name for a single-input model);
* ``image.png`` / ``.jpg``: resized to the input's H×W, RGB, scaled to [0, 1] and
  normalised with ``mean``/``std`` (ImageNet's by default), NCHW;
* nothing: seeded random arrays (:func:`random_inputs`), for smoke tests.

Every problem with an input file is an :class:`~tvm_layerfuse.errors.InputError`; outputs
are written by :func:`write_outputs` atomically, as an ``.npz`` whose entries are the
output names (whatever they are).
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Mapping, Sequence, Union

import numpy as np

from ..errors import InputError, UsageError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".webp"}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def read_inputs(
    specs: Sequence[dict[str, Any]],
    items: Sequence[str],
    *,
    seed: int = 0,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> dict[str, np.ndarray]:
    """Arrays for the model inputs described by ``specs`` (the manifest's ``inputs``) from
    ``--input`` items ``FILE`` or ``NAME=FILE``; seeded random arrays when there are none."""
    names = [s["name"] for s in specs]
    by_name = {s["name"]: s for s in specs}
    if not items:
        return random_inputs(specs, seed=seed)
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
    if len(names) == 1 and len(arrays) == 1:  # one array for the one input, whatever its name
        return {names[0]: next(iter(arrays.values()))}
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


def random_inputs(specs: Sequence[Mapping[str, Any]], *, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random arrays of the specs' shapes and dtypes (standard normal for floats)."""
    rng = np.random.default_rng(seed)
    values = {}
    for spec in specs:
        dtype = np.dtype(spec["dtype"])
        shape = [int(d) for d in spec["shape"]]
        if np.issubdtype(dtype, np.floating):
            values[spec["name"]] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            values[spec["name"]] = rng.integers(0, 2, shape).astype(dtype)
        else:
            values[spec["name"]] = rng.integers(0, 10, shape).astype(dtype)
    return values


def check_output_path(path: Union[str, os.PathLike]) -> Path:
    """``path`` as an ``--output`` .npz whose directory exists (checked before any work)."""
    path = Path(path)
    if path.suffix != ".npz":
        raise UsageError(f"--output {str(path)!r} must end in .npz (outputs are written by name)")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"output directory {str(parent)!r} does not exist; create it or choose another --output")
    return path


def savez(file: Union[str, os.PathLike, BinaryIO], arrays: Mapping[str, np.ndarray]) -> None:
    """``np.savez``'s own layout, written entry by entry, so that any name is a valid key
    (``np.savez(file, **arrays)`` takes an array called ``file`` for its own argument)."""
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in arrays.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as entry:
                np.lib.format.write_array(entry, np.asanyarray(value), allow_pickle=False)


def write_outputs(path: Union[str, os.PathLike], outputs: Mapping[str, np.ndarray]) -> Path:
    """Write ``outputs`` to the .npz ``path`` atomically (a temporary file beside it, then
    rename): all or nothing, entries named after the outputs (:func:`savez`)."""
    path = check_output_path(path)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    except OSError as e:
        raise UsageError(f"cannot write {str(path)!r} ({e.strerror}); choose a writable --output") from None
    try:
        with os.fdopen(fd, "wb") as f:
            savez(f, outputs)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
