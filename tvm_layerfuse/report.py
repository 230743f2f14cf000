"""Reports: :class:`Report`, the one shape of what a stage reports, and human-readable views
of topology graphs and fusion plans (text tables).

``inspect`` prints three sections: the first topology graph, the plan (what merged, with
which template, and every refused candidate with its reason), and the second topology
graph. JSON comes from ``FusionPlan.to_dict``; pictures from :mod:`tvm_layerfuse.dot`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

if TYPE_CHECKING:
    from .planner import FusionPlan
    from .templates.base import FusionGroup
    from .topology.graph import Layer, TopologyGraph


class Report:
    """Base of the reports the stages hand on (each a dataclass): a pass's report, the fuse
    report, the lowering reports.

    :meth:`to_dict` gives plain JSON data: every field, a nested report or record through its
    own ``to_dict``, tuples as lists. ``report["field"]`` reads a field.
    """

    def to_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def __getitem__(self, name: str) -> Any:
        if name not in {f.name for f in dataclasses.fields(self)}:
            raise KeyError(name)
        return getattr(self, name)


def plain(value: Any) -> Any:
    """``value`` as JSON data: reports and records (dataclasses) as dicts, tuples as lists."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, max_width: int = 60) -> str:
    """A plain-text table with aligned columns; long cells are cut with '…'."""
    cells = [[_cut(str(c), max_width) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(), line]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(out)


def _cut(s: str, width: int) -> str:
    return s if len(s) <= width else s[: width - 1] + "…"


def shape_str(shape: Optional[Sequence[Optional[int]]]) -> str:
    if shape is None:
        return "?"
    return "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"


def layer_label(layer: Layer) -> str:
    """``Conv+BatchNormalization+Relu`` for a fused layer, the op type otherwise."""
    f = layer.fused
    if f.in_place:
        return f"{layer.op_type}(in place)"
    parts = [e.op for e in f.prologue] + [layer.op_type] + [e.op for e in f.epilogue]
    if f.split:
        return f"{len(f.split)}x" + "+".join(parts) + "(merged)"
    return "+".join(parts)


def graph_table(graph: TopologyGraph) -> str:
    rows = []
    for i, layer in enumerate(graph):
        weights = ", ".join(f"{shape_str(graph.tensor(w).shape)}" for w in graph.const_inputs(layer)[:3])
        if len(graph.const_inputs(layer)) > 3:
            weights += ", …"
        outs = " ".join(shape_str(graph.tensor(o).shape) for o in layer.outputs)
        notes = []
        if len(layer.members) > 1:
            notes.append(f"{len(layer.members)} layers")
        for tensor, w in layer.fused.writes_into.items():
            off = "strided" if w.byte_offset is None else f"@{w.byte_offset}B"
            notes.append(f"{tensor}->{w.concat}[{w.range[0]}:{w.range[1]}]{off}")
        if layer.attrs.get("_unknown_op"):
            notes.append("unknown op, left unfused")
        rows.append(
            [
                i,
                layer.name,
                layer_label(layer),
                ", ".join(graph.data_inputs(layer)),
                weights,
                outs,
                graph.tensor(layer.outputs[0]).dtype or "?" if layer.outputs else "",
                "; ".join(notes),
            ]
        )
    head = (
        f"{graph.name}: {len(graph)} layers, opset {graph.opset}, inputs "
        + ", ".join(f"{n} {shape_str(graph.tensor(n).shape)}" for n in graph.inputs)
    )
    return head + "\n" + table(["#", "layer", "op", "inputs", "weights", "output", "dtype", "notes"], rows)


def group_summary(group: FusionGroup) -> str:
    d = group.details
    if group.kind == "vertical":
        if "prologue" in d:
            return "prologue " + "+".join(d["prologue"]) + f" into conv {d['conv']}"
        what = "+".join(d.get("folded", []))
        act = d.get("activation")
        return (f"fold {what}" if what else "no fold") + (f", epilogue {act}" if act else "")
    if group.kind == "horizontal":
        ranges = ", ".join(f"{s['branch']}[{s['channels'][0]}:{s['channels'][1]}]" for s in d["split"])
        return f"{len(d['split'])} convs on {d['input']} -> one conv of {d['out_channels']} channels, split {ranges}"
    if group.kind == "eltwise":
        act = f" + {d['activation']}" if d.get("activation") else ""
        mode = "may overwrite" if d.get("overwrite_extra_input") else "reads"
        return f"{d['op']}{act} into conv {d['conv']} epilogue; {mode} extra input {d['extra_input']}"
    if group.kind == "concat":
        offs = ", ".join(
            f"{o['tensor']}[{o['range'][0]}:{o['range'][1]}]"
            + ("" if o["byte_offset"] is None else f"@{o['byte_offset']}B")
            for o in d["offsets"]
        )
        layout = "contiguous" if d["contiguous"] else "strided"
        return f"axis {d['axis']}, {layout} block of {d['block_bytes']} B: {offs}"
    return ", ".join(f"{k}={v}" for k, v in d.items())


def plan_text(plan: FusionPlan, *, graphs: bool = True) -> str:
    c = plan.counts()
    parts = []
    if graphs:
        parts += ["== first topology graph ==", graph_table(plan.first), ""]
    parts.append("== fusion plan ==")
    parts.append(
        f"{c['groups']} groups: {c['vertical']} vertical, {c['horizontal']} horizontal, "
        f"{c['eltwise']} element-wise, {c['concat_in_place']} in-place concat; {c['refused']} candidates refused"
    )
    parts.append(
        f"layers: {c['layers_first']} -> {c['layers_intermediate']} after vertical -> {c['layers_second']} "
        f"({c['kernels_second']} kernels; in-place concats cost none)"
    )
    if plan.graph_notes():
        parts += [f"note: {n}" for n in plan.graph_notes()]
    rows = [[g.id, g.template, g.layer, " ".join(g.members), group_summary(g)] for g in plan.groups]
    parts.append(table(["id", "template", "layer", "members", "merge"], rows, max_width=110))
    if plan.refusals:
        parts.append("")
        parts.append("refused:")
        rows = [[r.template, " ".join(r.layers), r.reason] for r in plan.refusals]
        parts.append(table(["template", "layers", "reason"], rows, max_width=140))
    if graphs:
        parts += ["", "== second topology graph ==", graph_table(plan.second)]
    return "\n".join(parts)
