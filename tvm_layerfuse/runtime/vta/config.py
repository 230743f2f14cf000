"""VTA hardware configuration as data: the fields of VTA's ``vta_config.json``.

The accelerator is parameterised by base-2 logarithms (``LOG_*``): element widths, the
GEMM block (``BATCH x BLOCK_IN`` inputs times ``BLOCK_IN x BLOCK_OUT`` weights) and the
byte sizes of the four on-chip buffers. Everything else follows::

    block        = 2**LOG_BLOCK                       (BLOCK_IN = BLOCK_OUT)
    inp element  = BATCH * BLOCK_IN  * INP_WIDTH / 8  bytes    (one input vector)
    wgt element  = BLOCK_OUT * BLOCK_IN * WGT_WIDTH / 8 bytes  (one weight block)
    acc element  = BATCH * BLOCK_OUT * ACC_WIDTH / 8  bytes    (one accumulator vector)
    out element  = BATCH * BLOCK_OUT * OUT_WIDTH / 8  bytes    (OUT_WIDTH = INP_WIDTH)
    uop element  = 4 bytes
    depth(kind)  = buffer bytes / element bytes

The instruction fields that index those buffers are ``log2(depth)`` bits wide (see
:mod:`tvm_layerfuse.runtime.vta.isa`). The default is VTA's shipped configuration (PYNQ-Z1 class:
int8 x int8 -> int32, 16 x 16 block, batch 1).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Union

from ...errors import UsageError
from .encoding import check_layout

UOP_WIDTH_BITS = 32
LOG_FIELDS = (
    "LOG_INP_WIDTH",
    "LOG_WGT_WIDTH",
    "LOG_ACC_WIDTH",
    "LOG_BATCH",
    "LOG_BLOCK",
    "LOG_UOP_BUFF_SIZE",
    "LOG_INP_BUFF_SIZE",
    "LOG_WGT_BUFF_SIZE",
    "LOG_ACC_BUFF_SIZE",
)
_BOUNDS = {  # what the simulator and the code generator support
    "LOG_INP_WIDTH": (3, 3),
    "LOG_WGT_WIDTH": (3, 3),
    "LOG_ACC_WIDTH": (5, 5),
    "LOG_BATCH": (0, 0),
    "LOG_BLOCK": (1, 6),
    "LOG_UOP_BUFF_SIZE": (10, 20),
    "LOG_INP_BUFF_SIZE": (10, 24),
    "LOG_WGT_BUFF_SIZE": (10, 24),
    "LOG_ACC_BUFF_SIZE": (10, 24),
}


@dataclass(frozen=True)
class VTAConfig:
    """One VTA configuration (field names and meaning as in ``vta_config.json``)."""

    TARGET: str = "sim"
    HW_VER: str = "0.0.2"
    LOG_INP_WIDTH: int = 3
    LOG_WGT_WIDTH: int = 3
    LOG_ACC_WIDTH: int = 5
    LOG_BATCH: int = 0
    LOG_BLOCK: int = 4
    LOG_UOP_BUFF_SIZE: int = 15
    LOG_INP_BUFF_SIZE: int = 15
    LOG_WGT_BUFF_SIZE: int = 18
    LOG_ACC_BUFF_SIZE: int = 17

    # ------------------------------------------------------------------ derived sizes
    @property
    def inp_width(self) -> int:
        return 1 << self.LOG_INP_WIDTH

    @property
    def wgt_width(self) -> int:
        return 1 << self.LOG_WGT_WIDTH

    @property
    def acc_width(self) -> int:
        return 1 << self.LOG_ACC_WIDTH

    @property
    def out_width(self) -> int:
        return self.inp_width

    @property
    def batch(self) -> int:
        return 1 << self.LOG_BATCH

    @property
    def block(self) -> int:
        return 1 << self.LOG_BLOCK

    block_in = block
    block_out = block

    def elem_bytes(self, kind: str) -> int:
        """Bytes of one element of buffer ``kind``: a micro-op (32 bits), or a ``[rows, block]``
        tile of the kind's width (``rows``: the batch, or the block for a weight matrix)."""
        if kind == "uop":
            return UOP_WIDTH_BITS // 8
        rows = self.block if kind == "wgt" else self.batch
        return rows * self.block * getattr(self, f"{kind}_width") // 8

    def depth(self, kind: str) -> int:
        """Elements buffer ``kind`` (uop, inp, wgt, acc) holds: ``2**LOG_<KIND>_BUFF_SIZE`` bytes over one element's."""
        return (1 << getattr(self, f"LOG_{kind.upper()}_BUFF_SIZE")) // self.elem_bytes(kind)

    def log_depth(self, kind: str) -> int:
        """``log2(depth(kind))``: the width of an index into that buffer (``hw_spec.h``'s ``LOG_<KIND>_DEPTH``)."""
        return self.depth(kind).bit_length() - 1

    inp_elem_bytes = property(lambda self: self.elem_bytes("inp"))
    wgt_elem_bytes = property(lambda self: self.elem_bytes("wgt"))
    acc_elem_bytes = property(lambda self: self.elem_bytes("acc"))
    out_elem_bytes = property(lambda self: self.elem_bytes("out"))
    uop_elem_bytes = property(lambda self: self.elem_bytes("uop"))
    uop_depth = property(lambda self: self.depth("uop"))
    inp_depth = property(lambda self: self.depth("inp"))
    wgt_depth = property(lambda self: self.depth("wgt"))
    acc_depth = property(lambda self: self.depth("acc"))
    log_uop_depth = property(lambda self: self.log_depth("uop"))
    log_inp_depth = property(lambda self: self.log_depth("inp"))
    log_wgt_depth = property(lambda self: self.log_depth("wgt"))
    log_acc_depth = property(lambda self: self.log_depth("acc"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> dict[str, Any]:
        """The configuration and its derived sizes (what ``inspect`` shows)."""
        out = self.to_dict()
        out.update(
            block=self.block,
            depths={k: self.depth(k) for k in ("uop", "inp", "wgt", "acc")},
            elem_bytes={k: self.elem_bytes(k) for k in ("uop", "inp", "wgt", "acc", "out")},
        )
        return out


DEFAULT = VTAConfig()


def config_from_dict(data: Mapping[str, Any], *, source: str = "VTA configuration") -> VTAConfig:
    """Validate ``data`` (the keys of ``vta_config.json``) into a :class:`VTAConfig`.

    ``LOG_BLOCK_IN``/``LOG_BLOCK_OUT`` (older files) are accepted when equal."""
    if not isinstance(data, Mapping):
        raise UsageError(f"{source}: expected a JSON object with the keys of vta_config.json, found {type(data).__name__}")
    data = dict(data)
    if "LOG_BLOCK" not in data and ("LOG_BLOCK_IN" in data or "LOG_BLOCK_OUT" in data):
        bi, bo = data.get("LOG_BLOCK_IN"), data.get("LOG_BLOCK_OUT", data.get("LOG_BLOCK_IN"))
        if bi != bo:
            raise UsageError(
                f"{source}: LOG_BLOCK_IN={bi} and LOG_BLOCK_OUT={bo} differ; expected a square GEMM block - "
                "set both to the same value (or give LOG_BLOCK)"
            )
        data["LOG_BLOCK"] = bi
    data.pop("LOG_BLOCK_IN", None)
    data.pop("LOG_BLOCK_OUT", None)
    data.pop("LOG_BUS_WIDTH", None)  # the AXI width does not change what the program computes
    known = set(VTAConfig.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(
            f"{source}: unknown key(s) {', '.join(unknown)}; expected the keys of vta_config.json "
            f"({', '.join(sorted(known))}) - remove or rename them"
        )
    for key in LOG_FIELDS:
        if key not in data:
            continue
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{source}: {key} is {value!r}; expected an integer (a base-2 logarithm) - fix the value")
        lo, hi = _BOUNDS[key]
        if not lo <= value <= hi:
            want = f"{lo}" if lo == hi else f"{lo}..{hi}"
            raise UsageError(
                f"{source}: {key} is {value}; expected {want} (what this simulator and code generator support) - "
                "use VTA's default configuration values for the widths and batch"
            )
    for key in ("TARGET", "HW_VER"):
        if key in data and not isinstance(data[key], str):
            raise UsageError(f"{source}: {key} is {data[key]!r}; expected a string - fix the value")
    cfg = VTAConfig(**data)
    for kind in ("uop", "inp", "wgt", "acc"):
        if cfg.depth(kind) < 16:
            raise UsageError(
                f"{source}: LOG_{kind.upper()}_BUFF_SIZE={getattr(cfg, f'LOG_{kind.upper()}_BUFF_SIZE')} gives a "
                f"{kind} buffer of {cfg.depth(kind)} elements; expected at least 16 - enlarge the buffer"
            )
    problem = check_layout(cfg)
    if problem:
        raise UsageError(f"{source}: {problem}; expected every field to fit - reduce the buffer sizes")
    return cfg


def preset_config(name: str = "vta") -> VTAConfig:
    """The ``vta`` block of a target preset (``targets/vta.json``)."""
    import importlib.resources

    res = importlib.resources.files("tvm_layerfuse.targets") / f"{name}.json"
    try:
        data = json.loads(res.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"target preset {name!r} cannot be read ({exc}); expected targets/{name}.json - reinstall the package") from None
    if "vta" not in data:
        raise UsageError(f"target preset {name!r} has no 'vta' block; expected the keys of vta_config.json under 'vta' - add them")
    return config_from_dict(data["vta"], source=f"target preset {name!r}")


def load_config(path: Union[str, Path]) -> VTAConfig:
    """Read and validate a ``vta_config.json`` file (or a target preset with a ``vta`` block)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"VTA configuration {str(p)!r} cannot be read ({exc.strerror}); expected a JSON file - check the path") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"VTA configuration {str(p)!r} is not valid JSON (line {exc.lineno}: {exc.msg}); expected the format of "
            "vta_config.json - fix the file"
        ) from None
    if isinstance(data, dict) and isinstance(data.get("vta"), dict):
        data = data["vta"]
    return config_from_dict(data, source=f"VTA configuration {str(p)!r}")
