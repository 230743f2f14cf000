"""LegalizeBlockedConv: a conv2d in the blocked layout NCHW[x]c (weights OIHW[x]i[x]o) becomes
TOPI's ``conv2d_NCHWc`` kernel.

::

    out[n, O_o, y, x, o_i] = sum_{c, ry, rx} pad(data)[n, c // B, y*s + ry*d, x*s + rx*d, c % B]
                                               * W[O_o, c // B, ry, rx, c % B, o_i]

TVM 0.27's ``LegalizeOps`` legalizes only 4-d conv layouts (it leaves a blocked conv2d as a
Relax op, which no backend builds); this pass, put right before it, legalizes the blocked
ones with ``topi.nn.conv2d_NCHWc`` (the compute TVM's x86 conv strategy used), the blocked
depthwise ones (weights OIHW1i[x]o) with :func:`depthwise_conv2d_nchwc`, and leaves every
other call to ``LegalizeOps``. TVM's ``AnnotateTIROpPattern`` + ``FuseOps`` then fuse the
epilogue (bias, activation, residual add) into it as into the NCHW conv, and the schedule rule
``compile/schedules/conv2d_nchwc.py`` gives it its loop nest. Needs the target in context
(``topi.nn.conv2d_NCHWc`` reads it).
"""

from __future__ import annotations

import tvm
from tvm import relax, te, topi
from tvm.relax.transform.legalize_ops.nn import _nn_conv2d

__all__ = ["LegalizeBlockedConv", "depthwise_conv2d_nchwc", "is_blocked_conv", "is_blocked_depthwise"]


def is_blocked_conv(call: relax.Call) -> bool:
    """``call`` is a conv2d in NCHW[x]c / OIHW[x]i[x]o with the same block for data, kernel
    and output, or NCHW[k]c / OIHW[k]i[x]o -> NCHW[x]c (a narrow input as one block), or a
    blocked depthwise conv (what :class:`..relax.blocked_layout.BlockedConvLayout` writes)."""
    a = call.attrs
    data, kernel, out = str(a.data_layout), str(a.kernel_layout), str(a.out_layout or a.data_layout)
    if not (data.startswith("NCHW") and data.endswith("c") and data[4:-1].isdigit()):
        return False
    b = data[4:-1]
    if out == data:
        return (kernel == f"OIHW{b}i{b}o" and int(a.groups) == 1) or is_blocked_depthwise(call)
    # a narrow input (an image's channels as one block) into whole output blocks
    o = out[4:-1]
    narrow = out.startswith("NCHW") and out.endswith("c") and o.isdigit()
    return narrow and kernel == f"OIHW{b}i{o}o" and int(a.groups) == 1

def is_blocked_depthwise(call: relax.Call) -> bool:
    """A depthwise conv (one channel per group) in NCHW[x]c with weights OIHW1i[x]o."""
    a = call.attrs
    data = str(a.data_layout)
    if not (data.startswith("NCHW") and data.endswith("c") and data[4:-1].isdigit()):
        return False
    data_arg, _ = call.args
    shape = data_arg.ty.shape
    channels = int(shape[1]) * int(shape[4])
    return str(a.kernel_layout) == f"OIHW1i{data[4:-1]}o" and int(a.groups) == channels


def depthwise_conv2d_nchwc(data, kernel, strides, padding, dilation, out_dtype: str):
    """out[n, C_o, y, x, c_i] = sum_{ry, rx} pad(data)[n, C_o, y*s + ry*d, x*s + rx*d, c_i]
    * W[C_o, 0, ry, rx, 0, c_i] (TOPI's ``depthwise_conv2d_NCHWc`` has no generic compute)."""
    n, chunks, height, width, block = (int(d) for d in data.shape)
    kh, kw = int(kernel.shape[2]), int(kernel.shape[3])
    sh, sw = strides
    dh, dw = dilation
    top, left, bottom, right = padding
    out_h = (height + top + bottom - (kh - 1) * dh - 1) // sh + 1
    out_w = (width + left + right - (kw - 1) * dw - 1) // sw + 1
    pad = topi.nn.pad(data, [0, 0, top, left, 0], [0, 0, bottom, right, 0], name="data_pad") if any(padding) else data
    ry = te.reduce_axis((0, kh), name="ry")
    rx = te.reduce_axis((0, kw), name="rx")
    return te.compute(
        (n, chunks, out_h, out_w, block),
        lambda b, c, y, x, i: te.sum(
            pad[b, c, y * sh + ry * dh, x * sw + rx * dw, i].astype(out_dtype) * kernel[c, 0, ry, rx, 0, i].astype(out_dtype),
            axis=[ry, rx],
        ),
        name="depthwise_conv2d_NCHWc",
    )


def _legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    if not is_blocked_conv(call):
        return _nn_conv2d(bb, call)  # TVM's own legalization (4-d layouts; others stay Relax ops)
    a = call.attrs
    data, weight = call.args
    if is_blocked_depthwise(call):
        return bb.call_te(
            depthwise_conv2d_nchwc,
            data,
            weight,
            strides=[int(s) for s in a.strides],
            padding=[int(p) for p in a.padding],
            dilation=[int(d) for d in a.dilation],
            out_dtype=str(call.ty.dtype),
            primfunc_name_hint="depthwise_conv2d_NCHWc",
        )
    return bb.call_te(
        topi.nn.conv2d_NCHWc,
        data,
        weight,
        stride=[int(s) for s in a.strides],
        padding=[int(p) for p in a.padding],
        dilation=[int(d) for d in a.dilation],
        layout=str(a.data_layout),
        out_layout=str(a.out_layout),
        out_dtype=str(call.ty.dtype),  # out_dtype, or the inputs' where unset
        primfunc_name_hint="conv2d_NCHWc",
    )


def LegalizeBlockedConv() -> tvm.transform.Pass:  # noqa: N802 - a pass constructor, as TVM names them
    """``LegalizeOps`` with the blocked conv2d legalized by ``topi.nn.conv2d_NCHWc``."""
    return relax.transform.LegalizeOps(customize_legalize_map={"relax.nn.conv2d": _legalize})
