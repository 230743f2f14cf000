"""Host-side float operators of the VTA flow in numpy: the reference for the layers VTA does not run.

The host runs in float64 what the accelerator cannot: the stem convolution on the image,
pools, the classifier, softmax, and any fused layer the code generator refuses. Every
function takes and returns NCHW arrays. The same functions serve the calibration run (float
execution of the whole graph), the numpy int8 reference and the compiler's in-memory
simulator runs, so those share their host part exactly. A compiled artifact runs the same
host steps in TVM-compiled code instead (``host.so``, :mod:`.host_library`), equal to these
to float64 rounding (tests/test_vta_host_library.py).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from ...errors import BuildError


def conv2d(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, *, strides: Sequence[int], pads: Sequence[int],
           dilations: Sequence[int] = (1, 1), group: int = 1) -> np.ndarray:
    """``y[n, o, oh, ow] = sum_{c,i,j} x_pad[n, c, oh*s + i*d, ow*s + j*d] * w[o, c, i, j] + b[o]`` (grouped)."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape  # [C_out, C_in/g, kh, kw]
    sh, sw = strides
    dh, dw = dilations
    pt, pl, pb, pr = pads
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    eh, ew = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    win = np.lib.stride_tricks.sliding_window_view(xp, (eh, ew), axis=(2, 3))[:, :, ::sh, ::sw, ::dh, ::dw]
    oh, ow = win.shape[2], win.shape[3]
    win = win.reshape(n, group, c // group, oh, ow, kh, kw)
    wg = w.reshape(group, o // group, cg, kh, kw)
    y = np.einsum("ngchwij,gocij->ngohw", win, wg, optimize=True).reshape(n, o, oh, ow)
    if b is not None:
        y = y + b.reshape(1, -1, 1, 1)
    return y


def pool_out(size: int, k: int, stride: int, pad_begin: int, pad_end: int, ceil: bool) -> int:
    """Output length of a pooling along one axis, with torch's ceil-mode rule (the last
    window must start inside the input or the left padding)."""
    span = size + pad_begin + pad_end - k
    out = (-(-span // stride) if ceil else span // stride) + 1
    if ceil and (out - 1) * stride >= size + pad_begin:
        out -= 1
    return out


def pool2d(x: np.ndarray, *, op: str, kernel_shape, strides=None, pads=None, ceil_mode=0, count_include_pad=0, **_) -> np.ndarray:
    """ONNX MaxPool / AveragePool (NCHW, pads ``(top, left, bottom, right)``) in ``x``'s dtype."""
    n, c, h, w = x.shape
    kh, kw = kernel_shape
    sh, sw = strides or (1, 1)
    pt, pl, pb, pr = pads or (0, 0, 0, 0)
    oh, ow = pool_out(h, kh, sh, pt, pb, bool(ceil_mode)), pool_out(w, kw, sw, pl, pr, bool(ceil_mode))
    xb = max(0, (oh - 1) * sh + kh - (h + pt + pb))
    xr = max(0, (ow - 1) * sw + kw - (w + pl + pr))
    fill = -np.inf if op == "MaxPool" else 0.0
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb + xb), (pl, pr + xr)), constant_values=fill)
    win = np.lib.stride_tricks.sliding_window_view(xp, (kh, kw), axis=(2, 3))[:, :, ::sh, ::sw][:, :, :oh, :ow]
    if op == "MaxPool":
        return win.max(axis=(-2, -1))
    mask = np.zeros((1, 1) + xp.shape[2:], x.dtype)
    if count_include_pad:
        mask[..., : h + pt + pb, : w + pl + pr] = 1
    else:
        mask[..., pt : pt + h, pl : pl + w] = 1
    mwin = np.lib.stride_tricks.sliding_window_view(mask, (kh, kw), axis=(2, 3))[:, :, ::sh, ::sw][:, :, :oh, :ow]
    return win.sum(axis=(-2, -1)) / np.maximum(mwin.sum(axis=(-2, -1)), 1)


def _clip(ins, attrs):
    lo = ins[1] if len(ins) > 1 and ins[1] is not None else attrs.get("min")
    hi = ins[2] if len(ins) > 2 and ins[2] is not None else attrs.get("max")
    return np.clip(ins[0], lo, hi)


def _softmax(ins, attrs):
    x = ins[0]
    axis = int(attrs.get("axis", -1))
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _gemm(ins, attrs):
    a, b = ins[0], ins[1]
    if attrs.get("transA"):
        a = a.T
    if attrs.get("transB"):
        b = b.T
    y = float(attrs.get("alpha", 1.0)) * (a @ b)
    if len(ins) > 2 and ins[2] is not None:
        y = y + float(attrs.get("beta", 1.0)) * ins[2]
    return y


def _batchnorm(ins, attrs):
    x, g, b, m, v = ins[:5]
    shape = (1, -1) + (1,) * (x.ndim - 2)
    eps = float(attrs.get("epsilon", 1e-5))
    return (x - m.reshape(shape)) / np.sqrt(v.reshape(shape) + eps) * g.reshape(shape) + b.reshape(shape)


def _conv(ins, attrs):
    w = ins[1]
    rank = w.ndim - 2
    pads = attrs.get("pads", [0] * (2 * rank))
    if attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "", "VALID"):
        raise BuildError(
            f"Conv with auto_pad={attrs['auto_pad']} has no host implementation in the VTA flow; "
            "expected explicit pads - re-export with pads"
        )
    if rank != 2:
        raise BuildError(f"a {rank}-D Conv has no host implementation in the VTA flow; expected 2-D - use the cpu target")
    return conv2d(ins[0], w, ins[2] if len(ins) > 2 else None, strides=attrs.get("strides", [1, 1]), pads=pads,
                  dilations=attrs.get("dilations", [1, 1]), group=int(attrs.get("group", 1)))


def _lrn(ins, attrs):
    """ONNX LRN: ``y[c] = x[c] / (bias + alpha / size * sum_{c' in window(c)} x[c']**2) ** beta``,
    the window ``[c - floor((size-1)/2), c + ceil((size-1)/2)]`` cut at the channel range."""
    x = ins[0]  # [N, C, ...]
    size = int(attrs["size"])
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = np.pad(x * x, [(0, 0), (lo, hi)] + [(0, 0)] * (x.ndim - 2))  # [N, C + size - 1, ...]
    window = np.lib.stride_tricks.sliding_window_view(sq, size, axis=1).sum(axis=-1)  # [N, C, ...]
    alpha, beta, bias = float(attrs.get("alpha", 1e-4)), float(attrs.get("beta", 0.75)), float(attrs.get("bias", 1.0))
    return x / (bias + alpha / size * window) ** beta


def _reshape(ins, attrs):
    shape = [int(s) for s in ins[1]]
    shape = [ins[0].shape[k] if s == 0 else s for k, s in enumerate(shape)]
    return ins[0].reshape(shape)


HOST_OPS: dict[str, Callable[[list, dict[str, Any]], Any]] = {
    "Conv": _conv,
    "BatchNormalization": _batchnorm,
    "Relu": lambda ins, a: np.maximum(ins[0], 0),
    "LeakyRelu": lambda ins, a: np.where(ins[0] >= 0, ins[0], ins[0] * float(a.get("alpha", 0.01))),
    "Sigmoid": lambda ins, a: 1.0 / (1.0 + np.exp(-ins[0])),
    "Clip": _clip,
    "Add": lambda ins, a: ins[0] + ins[1],
    "Sub": lambda ins, a: ins[0] - ins[1],
    "Mul": lambda ins, a: ins[0] * ins[1],
    "Div": lambda ins, a: ins[0] / ins[1],
    "Sum": lambda ins, a: sum(ins[1:], ins[0]),
    "MaxPool": lambda ins, a: pool2d(ins[0], op="MaxPool", **a),
    "AveragePool": lambda ins, a: pool2d(ins[0], op="AveragePool", **a),
    "GlobalAveragePool": lambda ins, a: ins[0].mean(axis=tuple(range(2, ins[0].ndim)), keepdims=True),
    "GlobalMaxPool": lambda ins, a: ins[0].max(axis=tuple(range(2, ins[0].ndim)), keepdims=True),
    "Flatten": lambda ins, a: ins[0].reshape(int(np.prod(ins[0].shape[: int(a.get("axis", 1))])), -1),
    "Gemm": _gemm,
    "MatMul": lambda ins, a: ins[0] @ ins[1],
    "Concat": lambda ins, a: np.concatenate(ins, axis=int(a["axis"])),
    "Softmax": _softmax,
    "Identity": lambda ins, a: ins[0],
    "Dropout": lambda ins, a: ins[0],
    "Reshape": _reshape,
    "LRN": _lrn,
}


def run_op(op_type: str, attrs: Mapping[str, Any], ins: list) -> np.ndarray:
    """One host operator on float64 arrays (``ins`` in the op's input order, None if omitted)."""
    return np.asarray(HOST_OPS[op_type](ins, dict(attrs)), dtype=np.float64)


def apply_acts(y: np.ndarray, acts: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """ReLU / Clip entries ``{"kind", "lo", "hi"}`` in order."""
    for a in acts:
        if a["kind"] == "relu":
            y = np.maximum(y, 0)
        else:
            lo, hi = a.get("lo"), a.get("hi")
            y = np.clip(y, -np.inf if lo is None else lo, np.inf if hi is None else hi)
    return y


def run_steps(steps: Sequence[Mapping[str, Any]], values: dict[str, np.ndarray], consts: Mapping[str, np.ndarray]) -> None:
    """Interpret a host program (what an artifact stores for each host op); writes into ``values``.

    Steps: ``conv`` (x, w, b, strides, pads), ``add``, ``acts``, ``slice`` (channels), ``concat``
    (channels), ``layer`` (one ONNX op; inputs are tensor names or ``{"const": key}``)."""

    def arg(a: Optional[Any]):
        if a is None:
            return None
        if isinstance(a, dict):
            return consts[a["const"]]
        return values[a]

    for st in steps:
        op = st["op"]
        if op == "conv":
            y = conv2d(values[st["in"]], consts[st["w"]], consts[st["b"]], strides=st["strides"], pads=st["pads"])
        elif op == "add":
            y = values[st["in"][0]]
            for name in st["in"][1:]:
                y = y + values[name]
        elif op == "acts":
            y = apply_acts(values[st["in"]], st["acts"])
        elif op == "slice":
            y = values[st["in"]][:, st["c0"] : st["c1"]]
        elif op == "concat":
            y = np.concatenate([values[n] for n in st["in"]], axis=1)
        elif op == "layer":
            y = run_op(st["op_type"], st["attrs"], [arg(a) for a in st["in"]])
        else:
            raise BuildError(f"host step {op!r} is unknown; expected conv, add, acts, slice, concat or layer - rebuild the artifact")
        values[st["out"]] = y
