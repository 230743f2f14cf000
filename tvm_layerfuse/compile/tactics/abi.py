"""The calling contract between the Relax rewrites and the oneDNN tactic library, as code.

Every call the compiled model makes into ``onednn_conv.cc`` is described here once:

* the attribute records (:class:`ConvAttrs`, :class:`PoolAttrs`, :class:`ConcatSpec`): frozen
  dataclasses with named fields, ``to_shape()`` (the ``R.shape`` the call carries: integer
  shape entries are constants of the VM's pool) and ``from_shape()``; the C++ reads the same
  fields through named constants (``enum ConvField`` ... in ``onednn_conv.cc``) whose order
  a test checks against these field orders;
* the activations a conv epilogue may end with (:data:`ACTIVATIONS`, the codes of the C++
  table ``kActivations``, next to its post-op switch);
* the registry of library calls (:data:`CALLS`): per call its argument roles, the layouts
  its data inputs accept and its outputs have, whether it can write into a region of a
  concat block (a member of ``concat_convs``) and what it writes per inference
  (:func:`library_writes`).

Passes never index a call's arguments or attrs by position: they ask :func:`parse_call`
for a :class:`Bound` call (``bound.call.name``, ``bound.args.weight``, ``bound.attrs.groups``)
and rebuild it with :meth:`Bound.replace`. :data:`ABI_VERSION` changes whenever any of this
changes; the library exports the version it was built with (``layerfuse.onednn.abi_version``),
the manifest records it, and the loader refuses a library of another version.

Argument roles, in call order (outputs follow as the destination-passing arguments):

======================  =====================================================================
conv2d                  input, weight, bias, attrs                      -> out_1 .. out_k
                        (weight: plain [O, C/groups, kh, kw], or packed 1-d: ConvAttrs.packed)
conv2d_add              input, weight, bias, residual, attrs            -> out
conv2d_pre              inputs*, scale, shift, weight, bias, attrs      -> out_1 .. out_k
conv2d_add_inplace      input, weight, bias, residual, *attrs (TIR: the attrs as integers)
to_blocked              input, attrs                                    -> out
concat                  inputs*                                         -> out
concat_convs            spec, members* (each member: its call's own arguments)  -> out
pool2d                  input, attrs                                    -> out
scale_channels          input, scale, attrs (ScaleAttrs)                -> out
shuffle                 inputs* (a, b), attrs (ShuffleAttrs)            -> out
se_gate                 input, weight, bias, gate_weight, gate_bias, attrs (SeGateAttrs)  -> out
dense                   input, weight, bias, attrs (DenseAttrs)         -> out
======================  =====================================================================
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass, fields
from typing import Any, Optional, Sequence

ABI_VERSION = 9  # 1: the positional contract before this module; 2: concat_convs members carry their argument count;
# 3: block widths (0 plain, 8 nChw8c, 16 nChw16c) where 0/1 blocked flags were, to_blocked takes (block,);
# 4: a conv's weights may come packed (ConvAttrs.packed and the weight dims); dense takes attrs (DenseAttrs)
# 5: scale_channels (a squeeze-and-excitation gate in the convs' layout)
# 6: conv algorithms 2 and 3, the library's own Winograd kernels (AVX2)
# 7: shuffle (a channel range of ShuffleNet's two-group channel shuffle of a concatenation)
# 8: se_gate (a squeeze-and-excitation gate: the global average and the two 1x1 convs in one call)
# 9: the library's Winograd kernels (algorithms 2 and 3) on nChw16c too, with AVX-512

NAMESPACE = "layerfuse.onednn."
BLOCK_WIDTHS = (0, 8, 16)  # a blocked layout's channels per block (nChw8c, nChw16c); 0: plain NCHW
DST_BLOCK_BITS = 5  # a conv's dst_block: output j's block width in bits [5j, 5j + 5)
MAX_BLOCKED_OUTPUTS = 64 // DST_BLOCK_BITS - 1  # 11: outputs beyond stay plain

# a conv's algorithm: oneDNN's direct kernels, oneDNN's Winograd (AVX-512 in oneDNN 2.6), or the
# library's Winograd kernels (AVX2 on nChw8c, AVX-512 on nChw16c): output tiles of 2 along each
# axis its kernel spans (3x3, 5x5, 1x7, 7x1, 1x3, 3x1) or of 4x4 (3x3). A layer they do not fit
# runs direct, and `implementation` names the kernel that runs: ``winograd_<tile>_<kernel>`` +
# the suffix of its ISA (OWN_WINOGRAD_SUFFIXES, by block width) where it is the library's
CONV_ALGORITHMS = {"direct": 0, "winograd": 1, "own_winograd": 2, "own_winograd_4x4": 3}
OWN_WINOGRAD_SUFFIXES = {8: ":layerfuse_avx2", 16: ":layerfuse_avx512"}
# a conv whose SiLU the library applies in its own pass after oneDNN's kernel (no swish post-op):
# `implementation` ends with this
OWN_SILU_SUFFIX = "+silu:layerfuse"
OWN_WINOGRAD_KERNELS = {(3, 3): (2, 3), (5, 5): (2,), (1, 7): (2,), (7, 1): (2,), (1, 3): (2,), (3, 1): (2,)}  # kernel: algorithms


def is_own_winograd(kernel: str) -> bool:
    """Whether an ``implementation`` answer is one of the library's Winograd kernels."""
    return kernel.startswith("winograd_") and kernel.endswith(tuple(OWN_WINOGRAD_SUFFIXES.values()))


def dst_block(widths: Sequence[int]) -> int:
    """A conv's ``dst_block`` attr: output j's block width (0 plain, 8, 16) in its bits
    ``[5j, 5j + 5)``; one output: its width."""
    return sum(int(w) << (DST_BLOCK_BITS * j) for j, w in enumerate(widths) if j <= MAX_BLOCKED_OUTPUTS)


def dst_block_of(flags: int, j: int) -> int:
    """Output j's block width in a conv's ``dst_block`` attr (see :func:`dst_block`)."""
    return (int(flags) >> (DST_BLOCK_BITS * j)) & ((1 << DST_BLOCK_BITS) - 1) if j <= MAX_BLOCKED_OUTPUTS else 0


def layout_name(width: int) -> str:
    """``nchw`` for 0, ``nChw8c`` / ``nChw16c`` for a block width."""
    return f"nChw{int(width)}c" if width else "nchw"


def _check_width(what: str, width: int) -> None:
    if width not in BLOCK_WIDTHS:
        raise AbiError(f"{what}: a block width is 0, 8 or 16, got {width}")


def float_bits(value: float) -> int:
    """The bits of float32 ``value`` as a non-negative integer (how attrs carry alpha, beta)."""
    return int(struct.unpack("<I", struct.pack("<f", float(value)))[0])


def bits_float(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", int(bits) & 0xFFFFFFFF))[0])


# ---------------------------------------------------------------------- activations
# name -> code of the C++ table kActivations (same order); the post-op each one becomes is
# written next to it, in onednn_conv.cc. alpha/beta: what the attrs' alpha and beta carry.
ACTIVATIONS = {
    "none": 0,
    "relu": 1,  # alpha: the negative slope (LeakyRelu)
    "clip": 2,  # [alpha, beta]
    "silu": 3,  # x * sigmoid(x)
    "sigmoid": 4,
    "hardswish": 5,  # x * relu6(x + 3) / 6
    "hardsigmoid": 6,  # clip(alpha * x + beta, 0, 1)
    "gelu_erf": 7,  # x * (1 + erf(x / sqrt 2)) / 2
    "gelu_tanh": 8,  # x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))) / 2
}


class AbiError(ValueError):
    """A library call whose arguments or attrs do not follow this contract."""


# ---------------------------------------------------------------------- attribute records
class _Record:
    """Integer records carried as one ``R.shape``: field order is the contract."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def values(self) -> list[int]:
        return [int(getattr(self, n)) for n in self.names()]

    def to_shape(self):
        from tvm import relax

        return relax.ShapeExpr(self.values())

    @classmethod
    def from_shape(cls, shape) -> Any:
        """From an ``R.shape`` (``relax.ShapeExpr``), a ``tvm_ffi.Shape`` or a list of ints."""
        values = [int(v) for v in getattr(shape, "values", shape)]
        names = cls.names()
        if len(values) != len(names):
            raise AbiError(f"{cls.__name__} has {len(names)} fields ({', '.join(names)}), got {len(values)} values")
        record = cls(**dict(zip(names, values)))
        record.check()
        return record

    def replace(self, **changes) -> Any:
        return dataclasses.replace(self, **changes)

    def check(self) -> None:
        pass


@dataclass(frozen=True)
class ConvAttrs(_Record):
    """A conv layer's attrs: geometry, the epilogue's activation and the layouts of its bytes."""

    stride_h: int = 1
    stride_w: int = 1
    pad_top: int = 0
    pad_left: int = 0
    pad_bottom: int = 0
    pad_right: int = 0
    dilation_h: int = 1
    dilation_w: int = 1
    groups: int = 1
    act: int = 0  # ACTIVATIONS
    src_block: int = 0  # the input's block width (BLOCK_WIDTHS: 0 plain, 8 nChw8c, 16 nChw16c)
    dst_block: int = 0  # output j's block width in bits [5j, 5j + 5) (dst_block(), dst_block_of())
    alpha_bits: int = 0  # float32 bits
    beta_bits: int = 0
    algorithm: int = 0  # CONV_ALGORITHMS: 0 direct, 1 oneDNN's Winograd, 2 / 3 the library's (tiles of 2 / 4)
    layer: int = 0  # the layer's id in its module, assigned at compile time (the library's cache key)
    # the weights: 0 plain OIHW [O, C/groups, kh, kw]; else they come packed (1-d, the bytes of
    # each piece's weights in the layout its oneDNN primitive picks, see compile/tactics/prepack.py)
    # and this is that layout's identity (checked by the library), with their OIHW dims below
    packed: int = 0
    weight_o: int = 0
    weight_i: int = 0
    weight_kh: int = 0
    weight_kw: int = 0

    @classmethod
    def make(cls, *, strides, padding, dilation, groups: int, act: str = "none", alpha: float = 0.0, beta: float = 0.0):
        """From a conv's geometry (``padding``: top, left, bottom, right) and an activation name."""
        if act not in ACTIVATIONS:
            raise AbiError(f"unknown activation {act!r}; expected one of {', '.join(ACTIVATIONS)}")
        (sh, sw), (pt, pl, pb, pr), (dh, dw) = strides, padding, dilation
        return cls(sh, sw, pt, pl, pb, pr, dh, dw, int(groups), ACTIVATIONS[act], 0, 0, float_bits(alpha), float_bits(beta))

    @property
    def alpha(self) -> float:
        return bits_float(self.alpha_bits)

    @property
    def beta(self) -> float:
        return bits_float(self.beta_bits)

    @property
    def strides(self) -> tuple[int, int]:
        return self.stride_h, self.stride_w

    @property
    def dilation(self) -> tuple[int, int]:
        return self.dilation_h, self.dilation_w

    def check(self) -> None:
        if min(self.stride_h, self.stride_w, self.dilation_h, self.dilation_w, self.groups) < 1:
            raise AbiError(f"conv attrs need strides, dilations and groups >= 1: {self}")
        if min(self.pad_top, self.pad_left, self.pad_bottom, self.pad_right) < 0:
            raise AbiError(f"conv attrs need paddings >= 0: {self}")
        if self.act not in ACTIVATIONS.values():
            raise AbiError(f"unknown activation code {self.act}")
        if self.algorithm not in CONV_ALGORITHMS.values():
            raise AbiError(f"unknown conv algorithm {self.algorithm}")
        if self.layer < 0:
            raise AbiError(f"a layer id is >= 0, got {self.layer}")
        if self.packed < 0 or (self.packed and min(self.weight_dims) < 1):
            raise AbiError(f"packed conv attrs need an identity > 0 and weight dims >= 1: {self}")
        _check_width("conv attrs' src_block", self.src_block)
        if self.dst_block < 0:
            raise AbiError(f"conv attrs' dst_block is >= 0, got {self.dst_block}")
        for j in range(MAX_BLOCKED_OUTPUTS + 1):
            _check_width(f"conv attrs' dst_block (output {j})", self.dst_block_of(j))

    def dst_block_of(self, j: int) -> int:
        """Output j's block width (0 plain)."""
        return dst_block_of(self.dst_block, j)

    @property
    def weight_dims(self) -> tuple[int, int, int, int]:
        """Packed weights: their ``[O, C/groups, kh, kw]``."""
        return self.weight_o, self.weight_i, self.weight_kh, self.weight_kw

    def packed_as(self, identity: int, dims) -> "ConvAttrs":
        """These attrs for the call's weights packed into the layout ``identity`` (plain dims ``dims``)."""
        o, i, kh, kw = (int(d) for d in dims)
        return self.replace(packed=int(identity), weight_o=o, weight_i=i, weight_kh=kh, weight_kw=kw)


POOL_ALGORITHMS = {"max": 0, "avg_include_pad": 1, "avg": 2}


@dataclass(frozen=True)
class PoolAttrs(_Record):
    """A pooling layer's attrs (``alg``: :data:`POOL_ALGORITHMS`); src and dst share the block
    width ``block`` (0 plain)."""

    alg: int
    kernel_h: int
    kernel_w: int
    stride_h: int
    stride_w: int
    pad_top: int
    pad_left: int
    pad_bottom: int
    pad_right: int
    block: int = 0

    def check(self) -> None:
        if self.alg not in POOL_ALGORITHMS.values():
            raise AbiError(f"unknown pooling algorithm {self.alg}")
        if min(self.kernel_h, self.kernel_w, self.stride_h, self.stride_w) < 1:
            raise AbiError(f"pool attrs need kernel sizes and strides >= 1: {self}")
        _check_width("pool attrs' block", self.block)


@dataclass(frozen=True)
class ToBlockedAttrs(_Record):
    """``to_blocked``'s attrs: the block width its output is written in (8 or 16)."""

    block: int

    def check(self) -> None:
        if self.block == 0:
            raise AbiError("to_blocked's block is 8 or 16, got 0")
        _check_width("to_blocked's block", self.block)


@dataclass(frozen=True)
class ScaleAttrs(_Record):
    """``scale_channels``' attrs: the block width of its input and output (0 plain)."""

    block: int = 0

    def check(self) -> None:
        _check_width("scale_channels' block", self.block)


@dataclass(frozen=True)
class ShuffleAttrs(_Record):
    """``shuffle``'s attrs: its output is channels ``[first, first + length)`` of the two-group
    channel shuffle of ``concat(a, b)``, a and b of ``channels`` channels each (channel ``2i`` of
    the shuffle is a's ``i``, ``2i + 1`` b's ``i``); the block widths of a (the concatenation's
    left half), b (its right half) and the output (0 plain; a tensor whose channels are not
    whole blocks is in padded nChwBc)."""

    channels: int = 0
    first: int = 0
    length: int = 0
    left_block: int = 0
    right_block: int = 0
    dst_block: int = 0

    def check(self) -> None:
        for what in ("left_block", "right_block", "dst_block"):
            _check_width(f"shuffle's {what}", getattr(self, what))
        if self.channels < 1 or self.length < 1 or self.first < 0 or self.first + self.length > 2 * self.channels:
            raise AbiError(
                f"shuffle takes channels [first, first + length) of 2 x {self.channels}, got first {self.first}, length {self.length}"
            )


@dataclass(frozen=True)
class SeGateAttrs(_Record):
    """``se_gate``'s attrs: the block widths of its input (0 plain; padded ``nChwBc`` where the
    channels are not whole blocks) and of its output gate ``[N, C, 1, 1]``, and the activations
    after the squeeze conv and after the gate conv (codes of :data:`ACTIVATIONS`, alpha and beta
    as float32 bits, as a conv's attrs carry them)."""

    block: int = 0
    dst_block: int = 0
    squeeze_act: int = 0
    squeeze_alpha_bits: int = 0
    squeeze_beta_bits: int = 0
    gate_act: int = 0
    gate_alpha_bits: int = 0
    gate_beta_bits: int = 0

    def check(self) -> None:
        _check_width("se_gate's block", self.block)
        _check_width("se_gate's dst_block", self.dst_block)
        for what in ("squeeze_act", "gate_act"):
            if getattr(self, what) not in ACTIVATIONS.values():
                raise AbiError(f"se_gate's {what}: unknown activation code {getattr(self, what)}")


@dataclass(frozen=True)
class DenseAttrs(_Record):
    """``dense``'s attrs: ``packed`` 0 for plain weights ``[K, M]``; else the identity of the
    layout its oneDNN matmul picks, the weights coming packed in it (1-d), ``k`` and ``m`` their dims."""

    packed: int = 0
    k: int = 0
    m: int = 0

    def check(self) -> None:
        if self.packed < 0 or (self.packed and min(self.k, self.m) < 1):
            raise AbiError(f"packed dense attrs need an identity > 0 and k, m >= 1: {self}")


# members of concat_convs: how each piece of the block is made
COPY, CONV, CONV_PRE, CONV_ADD = 0, 1, 2, 3


@dataclass(frozen=True)
class Member:
    """One piece of a ``concat_convs`` block: ``kind`` (COPY, or the member kind of a conv call),
    its first channel ``offset`` in the block, and how many call arguments it takes (``nargs``)."""

    kind: int
    offset: int
    nargs: int


@dataclass(frozen=True)
class ConcatSpec:
    """``concat_convs``'s spec: the block's layout and its members, as
    ``(block, kind_1, offset_1, nargs_1, ..., kind_k, offset_k, nargs_k)`` (``block``: the
    block's width, 0 plain)."""

    block: int
    members: tuple[Member, ...] = ()

    FIELDS = ("kind", "offset", "nargs")  # per member, in this order after ``block``

    def values(self) -> list[int]:
        return [int(self.block)] + [int(getattr(m, f)) for m in self.members for f in self.FIELDS]

    def to_shape(self):
        from tvm import relax

        return relax.ShapeExpr(self.values())

    @classmethod
    def from_shape(cls, shape) -> "ConcatSpec":
        values = [int(v) for v in getattr(shape, "values", shape)]
        n = len(cls.FIELDS)
        if not values or (len(values) - 1) % n:
            raise AbiError(f"a concat_convs spec has 1 + {n} * members values, got {len(values)}")
        members = tuple(Member(*values[i : i + n]) for i in range(1, len(values), n))
        for m in members:
            if m.kind not in (COPY, CONV, CONV_PRE, CONV_ADD) or m.offset < 0 or m.nargs < 1:
                raise AbiError(f"bad concat_convs member {m}")
        _check_width("concat_convs' block", values[0])
        return cls(values[0], members)


# ---------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Args:
    """A library call's arguments by role (None: the call has no such role)."""

    inputs: tuple = ()  # the data inputs: one, or a concatenation's pieces (variadic roles)
    scale: Any = None
    shift: Any = None
    weight: Any = None
    bias: Any = None
    residual: Any = None
    gate_weight: Any = None  # se_gate: the second (excitation) conv's weight and bias
    gate_bias: Any = None
    attrs: Any = None  # the ``R.shape`` (or the spec of concat_convs)
    members: tuple = ()  # concat_convs: (Member, Bound) per piece

    @property
    def input(self):
        """The single data input (the first piece of a variadic one)."""
        return self.inputs[0]


@dataclass(frozen=True)
class LibraryCall:
    """One function of the tactic library.

    ``roles``: its arguments in call order (``inputs*`` variadic, at most one variadic role);
    ``attrs``: the record its ``attrs`` role holds; ``accepts`` / ``produces``: the layouts its
    data inputs and its outputs may have (``nChwBc`` only where the attrs' widths say so);
    ``member``: its member kind in ``concat_convs`` (it can write into a region of a block),
    else None; ``pieces``: it may have several outputs (a merged conv's split pieces)."""

    key: str
    roles: tuple[str, ...]
    attrs: Optional[type] = None
    accepts: tuple[str, ...] = ("nchw",)
    produces: tuple[str, ...] = ("nchw",)
    member: Optional[int] = None
    pieces: bool = False
    conv: bool = False

    @property
    def name(self) -> str:
        return NAMESPACE + self.key

    def bind(self, args: Sequence) -> Args:
        """The arguments ``args`` (call order) by role."""
        args = list(args)
        if self.key == "concat_convs":
            return _bind_members(args)
        variadic = [r for r in self.roles if r.endswith("*")]
        fixed = len(self.roles) - len(variadic)
        if (variadic and len(args) < fixed + 1) or (not variadic and len(args) != fixed):
            raise AbiError(f"{self.name} takes ({', '.join(self.roles)}), got {len(args)} arguments")
        named: dict = {}
        k = len(args) - fixed  # the variadic role's length
        i = 0
        for role in self.roles:
            if role.endswith("*"):
                named[role[:-1]] = tuple(args[i : i + k])
                i += k
            else:
                named[role if role != "input" else "inputs"] = (args[i],) if role == "input" else args[i]
                i += 1
        return Args(**named)

    def flatten(self, args: Args) -> list:
        """``args`` back in call order."""
        if self.key == "concat_convs":
            return [args.attrs] + [a for _, m in args.members for a in m.flat()]
        out: list = []
        for role in self.roles:
            if role in ("input", "inputs*"):
                out.extend(args.inputs)
            else:
                out.append(getattr(args, role.rstrip("*")))
        return out

    def parse_attrs(self, shape):
        return None if self.attrs is None or shape is None else self.attrs.from_shape(shape)


_EITHER = ("nchw", "nChwBc")  # plain, or blocked (B: the width the attrs say)
CONV2D = LibraryCall("conv2d", ("input", "weight", "bias", "attrs"), ConvAttrs, _EITHER, _EITHER, member=CONV, pieces=True, conv=True)
CONV2D_ADD = LibraryCall(
    "conv2d_add", ("input", "weight", "bias", "residual", "attrs"), ConvAttrs, _EITHER, _EITHER, member=CONV_ADD, conv=True
)
CONV2D_PRE = LibraryCall(
    "conv2d_pre", ("inputs*", "scale", "shift", "weight", "bias", "attrs"), ConvAttrs, _EITHER, _EITHER,
    member=CONV_PRE, pieces=True, conv=True,
)
# called from TIR (a residual conv in place), its attrs as integer arguments after these
CONV2D_ADD_INPLACE = LibraryCall("conv2d_add_inplace", ("input", "weight", "bias", "residual"), ConvAttrs, _EITHER, _EITHER)
TO_BLOCKED = LibraryCall("to_blocked", ("input", "attrs"), ToBlockedAttrs, ("nchw",), ("nChwBc",))
CONCAT = LibraryCall("concat", ("inputs*",), None, _EITHER, _EITHER)
CONCAT_CONVS = LibraryCall("concat_convs", ("attrs", "members*"), ConcatSpec, _EITHER, _EITHER)
POOL2D = LibraryCall("pool2d", ("input", "attrs"), PoolAttrs, _EITHER, _EITHER)
# out = x * g, g [N, C, 1, 1] (the scale role): a squeeze-and-excitation gate
SCALE_CHANNELS = LibraryCall("scale_channels", ("input", "scale", "attrs"), ScaleAttrs, _EITHER, _EITHER)
DENSE = LibraryCall("dense", ("input", "weight", "bias", "attrs"), DenseAttrs)
# out = channels [first, first + length) of shuffle(concat(a, b)), inputs (a, b): ShuffleNet's channel shuffle
SHUFFLE = LibraryCall("shuffle", ("inputs*", "attrs"), ShuffleAttrs, _EITHER, _EITHER)
# out = act2(gate_weight act1(weight mean_hw(x) + bias) + gate_bias): a squeeze-and-excitation gate [N, C, 1, 1]
SE_GATE = LibraryCall("se_gate", ("input", "weight", "bias", "gate_weight", "gate_bias", "attrs"), SeGateAttrs, _EITHER, _EITHER)

CALLS: dict[str, LibraryCall] = {
    c.name: c
    for c in (
        CONV2D, CONV2D_ADD, CONV2D_PRE, CONV2D_ADD_INPLACE, TO_BLOCKED, CONCAT, CONCAT_CONVS, POOL2D, SCALE_CHANNELS, DENSE, SHUFFLE,
        SE_GATE,
    )
}
CONVS = (CONV2D, CONV2D_ADD, CONV2D_PRE)  # the conv calls Relax makes (call_dps_packed)
MEMBERS = {c.member: c for c in CALLS.values() if c.member is not None}


@dataclass(frozen=True)
class Bound:
    """A library call found in the IR: the registry entry, its arguments by role, its attrs."""

    call: LibraryCall
    args: Args
    attrs: Any = None  # the parsed record (ConvAttrs, PoolAttrs, ConcatSpec) or None

    def flat(self) -> list:
        return self.call.flatten(self.args)

    def replace(self, *, attrs=None, **roles) -> "Bound":
        """This call with some roles (``inputs=``, ``weight=`` ...) and/or its attrs record replaced."""
        args = self.args
        if attrs is not None:
            roles["attrs"] = attrs.to_shape()
        if roles:
            args = dataclasses.replace(args, **roles)
        return Bound(self.call, args, attrs if attrs is not None else self.attrs)

    def expr(self, out_ty):
        """``R.call_dps_packed`` of this call."""
        from tvm import relax

        return relax.call_dps_packed(self.call.name, self.flat(), out_ty)


def bind(call: LibraryCall, args: Sequence) -> Bound:
    bound = call.bind(args)
    return Bound(call, bound, call.parse_attrs(bound.attrs))


def make(call: LibraryCall, *, attrs=None, **roles) -> Bound:
    """A new call from its roles and attrs record."""
    if attrs is not None:
        roles["attrs"] = attrs.to_shape()
    if "input" in roles:
        roles["inputs"] = (roles.pop("input"),)
    return Bound(call, Args(**roles), attrs)


def _bind_members(args: list) -> Args:
    if not args:
        raise AbiError("concat_convs takes (spec, members...), got no arguments")
    spec = ConcatSpec.from_shape(args[0])
    rest, members, a = args[1:], [], 0
    for m in spec.members:
        piece = rest[a : a + m.nargs]
        if len(piece) != m.nargs:
            raise AbiError(f"concat_convs: member {m} needs {m.nargs} arguments, {len(piece)} left")
        inner = Bound(_COPY_MEMBER, Args(inputs=tuple(piece))) if m.kind == COPY else bind(MEMBERS[m.kind], piece)
        members.append((m, inner))
        a += m.nargs
    if a != len(rest):
        raise AbiError(f"concat_convs: {len(rest) - a} arguments left after the members of its spec")
    return Args(attrs=args[0], members=tuple(members))


_COPY_MEMBER = LibraryCall("copy", ("input",))  # a concat_convs piece that is copied (not a library function)


def concat_convs(block: int, pieces: Sequence[tuple[int, Bound]]) -> Bound:
    """A ``concat_convs`` call from its pieces ``(offset, member call)`` (copies: a Bound of
    :data:`COPY_MEMBER` over the piece)."""
    members = []
    for offset, b in pieces:
        kind = COPY if b.call is _COPY_MEMBER else b.call.member
        members.append((Member(kind, int(offset), len(b.flat())), b))
    spec = ConcatSpec(int(block), tuple(m for m, _ in members))
    return Bound(CONCAT_CONVS, Args(attrs=spec.to_shape(), members=tuple(members)), spec)


def copy_member(x) -> Bound:
    return Bound(_COPY_MEMBER, Args(inputs=(x,)))


def parse_call(value) -> Optional[Bound]:
    """The library call ``value`` makes (``R.call_dps_packed`` into this library), else None."""
    from tvm import relax

    if not isinstance(value, relax.Call) or not value.op.same_as(_dps()):
        return None
    func, call_args = value.args
    name = str(getattr(func, "global_symbol", ""))
    if not name.startswith(NAMESPACE):
        return None
    if name not in CALLS:
        raise AbiError(f"{name} is not a function of the tactic library (ABI {ABI_VERSION})")
    return bind(CALLS[name], list(call_args.fields))


def rebuild(value, bound: Bound):
    """The call ``value`` (a ``call_dps_packed`` into the library) with ``bound``'s arguments,
    its output types kept."""
    from tvm import relax

    func, _ = value.args
    return relax.Call(value.op, [func, relax.Tuple(bound.flat())], value.attrs, value.ty_args)


_DPS_OP: list = []


def _dps():
    if not _DPS_OP:
        import tvm

        _DPS_OP.append(tvm.ir.Op.get("relax.call_dps_packed"))
    return _DPS_OP[0]


# ---------------------------------------------------------------------- what a call writes
@dataclass(frozen=True)
class LibraryWrites:
    """Bytes one library call writes per inference: into its outputs, computed (``computed``)
    or copied (``copied``: a concat's pieces), and into its own scratch (``scratch``: the
    normalised input of a conv prologue)."""

    computed: int
    copied: int
    scratch: int
    residual: int = 0  # the residual a conv2d_add copies into its output before the conv


def _nbytes(expr_or_ty) -> int:
    import numpy as np

    ty = getattr(expr_or_ty, "ty", expr_or_ty)
    fs = getattr(ty, "fields", None)
    if fs is not None:
        return sum(_nbytes(f) for f in fs)
    dims = getattr(getattr(ty, "shape", None), "values", None)
    if dims is None:
        return 0
    try:
        n = int(np.prod([int(d) for d in dims], dtype=np.int64))
    except TypeError:  # a symbolic dimension
        return 0
    return n * np.dtype(str(ty.dtype)).itemsize


def writes_of(bound: Bound, out_ty) -> LibraryWrites:
    """What the library call ``bound`` with outputs ``out_ty`` writes per inference."""
    out = _nbytes(out_ty)
    call = bound.call
    if call is CONV2D_ADD:
        return LibraryWrites(out, 0, 0, residual=_nbytes(bound.args.residual))
    if call is CONCAT:
        return LibraryWrites(0, out, 0)
    if call is CONV2D_PRE:  # the pieces, normalised into the prologue's scratch
        return LibraryWrites(out, 0, sum(_nbytes(x) for x in bound.args.inputs))
    if call is CONCAT_CONVS:
        copied = scratch = 0
        for m, b in bound.args.members:
            if m.kind == COPY:
                copied += _nbytes(b.args.input)
            elif b.call is CONV2D_PRE:
                scratch += sum(_nbytes(x) for x in b.args.inputs)
        return LibraryWrites(out - copied, copied, scratch)
    return LibraryWrites(out, 0, 0)


INPLACE_WRAPPER = "layerfuse_onednn_conv2d_add_inplace"  # the TIR wrappers' names (a number may follow)


def library_writes(value) -> Optional[LibraryWrites]:
    """What a ``call_dps_packed`` into the library (or a residual conv in place: a
    ``call_tir_inplace`` of an :data:`INPLACE_WRAPPER`) writes per inference, else None."""
    from tvm import relax

    if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.call_tir_inplace":
        gv = value.args[0]
        if gv.name_hint.startswith(INPLACE_WRAPPER):
            return LibraryWrites(_nbytes(value), 0, 0)
        return None
    bound = parse_call(value)
    if bound is None:
        return None
    out_ty = value.ty_args[0] if value.ty_args else value.ty  # (the same once normalised)
    return writes_of(bound, out_ty)


def records() -> dict[str, tuple[str, tuple[str, ...]]]:
    """C++ enum -> (its entries' prefix, the names in order): the constants ``onednn_conv.cc``
    reads the contract through, as they must follow this module (tests)."""
    return {
        "ConvField": ("", ConvAttrs.names()),
        "PoolField": ("", PoolAttrs.names()),
        "ToBlockedField": ("", ToBlockedAttrs.names()),
        "ScaleField": ("scale_", ScaleAttrs.names()),
        "DenseField": ("dense_", DenseAttrs.names()),
        "ShuffleField": ("shuffle_", ShuffleAttrs.names()),
        "SeGateField": ("se_", SeGateAttrs.names()),
        "MemberField": ("", ConcatSpec.FIELDS),
        "Activation": ("", tuple(ACTIVATIONS)),
        "Conv2dArg": ("conv2d_", CONV2D.roles),
        "Conv2dAddInplaceArg": ("inplace_", CONV2D_ADD_INPLACE.roles),
    }


def check_record_order(source: str) -> list[str]:
    """Differences between the C++ enums in ``source`` and :func:`records` (empty: they agree).
    An entry ``kPoolStrideH`` of ``PoolField`` may repeat its enum's word (``pool_``) to stay
    unique in C++; a final ``...Count`` entry is the number of fields."""
    import re

    problems = []

    def snake(name: str) -> str:
        return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()

    for enum, (prefix, names) in records().items():
        m = re.search(r"enum\s+" + enum + r"\s*:\s*int\s*\{([^}]*)\}", source)
        if m is None:
            problems.append(f"enum {enum} not found")
            continue
        entries = [e.split("=")[0].strip() for e in m.group(1).split(",") if e.strip()]
        word = snake(enum).split("_")[0] + "_"
        cpp = []
        for e in entries:
            if not e.startswith("k") or e.endswith("Count"):
                continue
            name = snake(e[1:]).removeprefix(prefix)
            cpp.append(name.removeprefix(word) if name.removeprefix(word) in names and name not in names else name)
        if tuple(cpp) != tuple(names):
            problems.append(f"enum {enum}: C++ {cpp}, Python {list(names)}")
    return problems


__all__ = [
    "ABI_VERSION",
    "ACTIVATIONS",
    "AbiError",
    "Args",
    "Bound",
    "CALLS",
    "CONCAT",
    "CONCAT_CONVS",
    "CONV2D",
    "CONV2D_ADD",
    "CONV2D_ADD_INPLACE",
    "CONV2D_PRE",
    "CONVS",
    "ConcatSpec",
    "ConvAttrs",
    "DENSE",
    "DenseAttrs",
    "LibraryCall",
    "LibraryWrites",
    "Member",
    "POOL2D",
    "POOL_ALGORITHMS",
    "PoolAttrs",
    "SCALE_CHANNELS",
    "SHUFFLE",
    "SE_GATE",
    "SeGateAttrs",
    "ScaleAttrs",
    "ShuffleAttrs",
    "TO_BLOCKED",
    "ToBlockedAttrs",
    "BLOCK_WIDTHS",
    "DST_BLOCK_BITS",
    "MAX_BLOCKED_OUTPUTS",
    "dst_block",
    "dst_block_of",
    "layout_name",
    "bind",
    "concat_convs",
    "copy_member",
    "library_writes",
    "make",
    "parse_call",
    "rebuild",
]
