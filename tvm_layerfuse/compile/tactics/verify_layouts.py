"""The layout check at the end of the oneDNN tactic: every tensor whose bytes are oneDNN's
blocked ``nChwBc`` (B = 8 or 16; or padded ``nChwBc``, its channels rounded up to B) keeps its NCHW
Relax type, so nothing in the IR stops a later pass, or a TVM kernel, from reading those
bytes as NCHW. This check walks each function after the rewrites and finds every such value:

* made blocked by a library call whose block widths say so (a conv's ``dst_block`` for each
  output, a pool's or a channel scale's ``block``, a shuffle's or a squeeze-and-excitation
  gate's ``dst_block``, ``to_blocked``'s ``block``, a ``concat_convs`` block's
  ``block``, a ``concat`` of blocked pieces, a residual conv in place over a blocked residual);
* read only where the reader's widths say that same layout: a conv's input (``src_block``),
  its residual (the dst layout), a pool's, a channel scale's or a gate's input (``block``), a shuffle's
  two inputs (``left_block``, ``right_block``), a concat's pieces (all alike), a
  copy member of a ``concat_convs`` block (the block's layout);

and reports every other reader (a TVM kernel, a weight role, a reader whose flags say plain,
the function's result). A 4-d tensor with ``C % B == 0`` and 1x1 spatial has the same bytes
in both layouts and is read by anyone. :func:`check_layouts` raises on the first problems.
"""

from __future__ import annotations

from typing import Optional

from tvm import relax

from ...errors import BuildError
from ...relax._ir import is_primitive, op_name, relax_functions, static_shape
from . import abi

PLAIN = abi.layout_name(0)


def _width(layout: Optional[str]) -> int:
    """The block width of a layout name (``nChw8c``: 8; ``nchw``: 0)."""
    return int(layout[4:-1]) if layout and layout != PLAIN else 0


def _same_bytes(var, *layouts) -> bool:
    """``var`` has the same bytes in all ``layouts`` (1x1 spatial, C a multiple of each width)."""
    shape = static_shape(var)
    if shape is None or len(shape) != 4 or shape[2] * shape[3] != 1:
        return False
    return all(shape[1] % w == 0 for w in map(_width, layouts) if w)


def _flag(width: int) -> str:
    return abi.layout_name(width)


def verify_layouts(mod) -> list[str]:
    """Every blocked value of ``mod``'s Relax functions read where the reader does not say so
    (empty: none)."""
    problems: list[str] = []
    for gv, func in relax_functions(mod):
        if not is_primitive(func):
            problems += [f"{gv.name_hint}: {p}" for p in _verify(func)]
    return problems


def check_layouts(mod) -> None:
    problems = verify_layouts(mod)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise BuildError(f"oneDNN tactic: blocked tensors read as plain: {'; '.join(problems[:3])}{more}")


def _verify(func: relax.Function) -> list[str]:
    layout: dict = {}  # var -> BLOCKED | PLAIN, for values the library makes
    problems: list[str] = []

    def of(expr) -> Optional[str]:
        return layout.get(expr) if isinstance(expr, relax.Var) else None

    def expect(expr, want: str, reader: str) -> None:
        have = of(expr)
        if isinstance(have, tuple):  # a call's pieces, read whole
            have = next((p for p in have if p != PLAIN), PLAIN)
        if have is not None and have != want and not _same_bytes(expr, have, want):
            problems.append(f"{expr.name} is {have}, read by {reader} as {want}")

    def read_plain(expr, reader: str) -> None:
        for v in relax.analysis.free_vars(expr):
            expect(v, PLAIN, reader)

    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            bound = abi.parse_call(v)
            name = b.var.name
            if bound is not None:
                layout_of_call(bound, b.var, layout, expect, problems)
                continue
            if isinstance(v, relax.Var) and v in layout:  # an alias: the same bytes
                layout[b.var] = layout[v]
                continue
            if isinstance(v, relax.TupleGetItem) and isinstance(v.tuple_value, relax.Var) and v.tuple_value in layout:
                pieces = layout[v.tuple_value]
                layout[b.var] = pieces[int(v.index)] if isinstance(pieces, tuple) else pieces
                continue
            if op_name(v) == "relax.call_tir_inplace":
                callee, args = v.args
                if callee.name_hint.startswith(abi.INPLACE_WRAPPER):
                    fields = list(args.fields)
                    residual = fields[abi.CONV2D_ADD_INPLACE.roles.index("residual")]
                    for role, a in zip(abi.CONV2D_ADD_INPLACE.roles, fields):
                        if role in ("weight", "bias"):
                            expect(a, PLAIN, f"{name}'s {role}")
                    if of(residual) is not None:
                        layout[b.var] = of(residual)  # written in place: r's bytes, r's layout
                    continue
            read_plain(v, f"{name} ({op_name(v) or type(v).__name__})")
    read_plain(func.body.body, "the function's result")
    return problems


def layout_of_call(bound: abi.Bound, var, layout: dict, expect, problems: list) -> None:
    """Check what library call ``bound`` (bound to ``var``) reads, and record what it makes."""
    call, args, attrs = bound.call, bound.args, bound.attrs
    reader = f"{var.name} ({call.key})"
    for role in ("scale", "shift", "weight", "bias", "gate_weight", "gate_bias"):
        if getattr(args, role) is not None:
            expect(getattr(args, role), PLAIN, f"{reader}'s {role}")
    if call.conv:
        for x in args.inputs:
            expect(x, _flag(attrs.src_block), reader)
        if args.residual is not None:
            expect(args.residual, _flag(attrs.dst_block_of(0)), f"{reader}'s residual")
        if isinstance(var.ty, relax.TupleType):
            layout[var] = tuple(_flag(attrs.dst_block_of(j)) for j in range(len(var.ty.fields)))
        else:
            layout[var] = _flag(attrs.dst_block_of(0))
    elif call in (abi.POOL2D, abi.SCALE_CHANNELS):
        expect(args.input, _flag(attrs.block), reader)
        layout[var] = _flag(attrs.block)
    elif call is abi.SE_GATE:
        expect(args.input, _flag(attrs.block), reader)
        layout[var] = _flag(attrs.dst_block)
    elif call is abi.SHUFFLE:
        for x, block in zip(args.inputs, (attrs.left_block, attrs.right_block)):
            expect(x, _flag(block), reader)
        layout[var] = _flag(attrs.dst_block)
    elif call is abi.TO_BLOCKED:
        expect(args.input, PLAIN, reader)
        layout[var] = _flag(attrs.block)
    elif call is abi.CONCAT:
        seen = {layout.get(x) for x in args.inputs if isinstance(x, relax.Var) and not _same_bytes(x, layout.get(x))}
        seen -= {None}
        if len(seen) > 1:
            problems.append(f"{reader} joins pieces of both layouts")
        layout[var] = seen.pop() if seen else PLAIN
    elif call is abi.CONCAT_CONVS:
        block = _flag(attrs.block)
        for member, inner in args.members:
            if member.kind == abi.COPY:
                expect(inner.args.input, block, f"{reader}'s copy member")
                continue
            for x in inner.args.inputs:
                expect(x, _flag(inner.attrs.src_block), f"{reader}'s conv member")
            if inner.args.residual is not None:
                expect(inner.args.residual, _flag(inner.attrs.dst_block_of(0)), f"{reader}'s conv member's residual")
            if _flag(inner.attrs.dst_block_of(0)) != block:
                problems.append(f"{reader}: a conv member writes {_flag(inner.attrs.dst_block_of(0))} into a {block} block")
        layout[var] = block
    else:  # dense and anything plain
        for x in args.inputs:
            expect(x, PLAIN, reader)
        layout[var] = PLAIN
