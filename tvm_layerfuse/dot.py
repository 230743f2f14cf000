"""Draw the first and second topology graphs side by side (Graphviz DOT, SVG).

The left cluster is the first graph with every fused group outlined (colour by kind:
vertical, horizontal, element-wise); producers that write in place into a Concat have
their edge drawn bold and dashed. The right cluster is the second graph, one box per
(fused) layer. SVG needs Graphviz's ``dot`` program (Debian/Ubuntu:
``apt-get install graphviz``; macOS: ``brew install graphviz``); without it the DOT text
is written instead.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from .errors import UsageError
from .planner import FusionPlan
from .report import layer_label, shape_str
from .topology.graph import TopologyGraph

log = logging.getLogger(__name__)

COLORS = {"vertical": "#1f77b4", "horizontal": "#d62728", "eltwise": "#2ca02c", "concat": "#9467bd"}
INSTALL_HINT = "install Graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz)"


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _kind(template: Optional[str]) -> str:
    if not template:
        return ""
    last = template.split("+")[-1]
    return last.split(".")[0]


def to_dot(plan: FusionPlan) -> str:
    """DOT text with both graphs side by side and fused groups outlined."""
    lines = [
        "digraph layerfuse {",
        "  rankdir=TB; compound=true; newrank=true;",
        '  node [shape=box, style="rounded,filled", fillcolor="#ffffff", fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=8, color="#555555"];',
    ]
    lines += _cluster(plan.first, "a", f"first topology graph ({len(plan.first)} layers)", outline=plan.second)
    lines += _cluster(plan.second, "b", f"second topology graph ({len(plan.second)} layers)", outline=None)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _cluster(graph: TopologyGraph, prefix: str, title: str, *, outline: Optional[TopologyGraph]) -> list[str]:
    out = [f"  subgraph cluster_{prefix} {{", f"    label={_q(title)}; fontsize=14; color=\"#aaaaaa\";"]
    grouped: dict[str, str] = {}
    if outline is not None:
        for k, layer in enumerate(outline):
            if len(layer.members) < 2:
                continue
            color = COLORS.get(_kind(layer.template), "#ff7f0e")
            out.append(f"    subgraph cluster_{prefix}_g{k} {{")
            out.append(f"      label={_q(layer.template or '')}; fontsize=9; color={_q(color)}; penwidth=2;")
            for m in layer.members:
                grouped[m] = layer.name
                out.append(f"      {_q(prefix + ':' + m)};")
            out.append("    }")
    in_place = set()
    for layer in graph if outline is None else outline:
        for tensor in layer.fused.writes_into:
            in_place.add(tensor)
    for layer in graph:
        label = f"{layer.name}\\n{layer_label(layer) if outline is None else layer.op_type}"
        if layer.outputs:
            label += "\\n" + " ".join(shape_str(graph.tensor(o).shape) for o in layer.outputs)
        attrs = [f"label={_q(label)}"]
        if outline is None and layer.template:
            attrs.append(f"fillcolor={_q(COLORS.get(_kind(layer.template), '#ff7f0e') + '33')}")
        if layer.attrs.get("_unknown_op"):
            attrs.append('fillcolor="#dddddd"')
        out.append(f"    {_q(prefix + ':' + layer.name)} [{', '.join(attrs)}];")
    for name in graph.inputs:
        out.append(f"    {_q(prefix + ':in:' + name)} [label={_q(name + chr(10) + shape_str(graph.tensor(name).shape))}, shape=oval];")
    for name in graph.outputs:
        out.append(f"    {_q(prefix + ':out:' + name)} [label={_q(name)}, shape=oval];")
    for layer in graph:
        for t in graph.data_inputs(layer):
            src = graph.tensor(t).producer
            src_id = prefix + ":" + src if src else prefix + ":in:" + t
            style = ', style="bold,dashed", color="#9467bd"' if t in in_place else ""
            out.append(f"    {_q(src_id)} -> {_q(prefix + ':' + layer.name)} [label={_q(t)}{style}];")
    for name in graph.outputs:
        src = graph.tensor(name).producer
        if src:
            out.append(f"    {_q(prefix + ':' + src)} -> {_q(prefix + ':out:' + name)};")
    out.append("  }")
    return out


def write_dot(plan: FusionPlan, path: Path) -> Path:
    _write_atomic(path, to_dot(plan).encode())
    return path


def write_svg(plan: FusionPlan, path: Path) -> Path:
    """Write an SVG with Graphviz; without ``dot``, write DOT text beside it and say so."""
    text = to_dot(plan)
    exe = shutil.which("dot")
    if exe is None:
        fallback = path.with_suffix(".dot")
        _write_atomic(fallback, text.encode())
        log.warning("Graphviz 'dot' was not found; wrote DOT text to %s instead of SVG - %s", fallback, INSTALL_HINT)
        return fallback
    proc = subprocess.run([exe, "-Tsvg"], input=text.encode(), capture_output=True, timeout=300)
    if proc.returncode != 0:
        raise UsageError(
            f"Graphviz failed to draw {path}: {proc.stderr.decode(errors='replace').strip()[:200]}; "
            "use --dot to get the DOT text"
        )
    _write_atomic(path, proc.stdout)
    return path


def _write_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise UsageError(f"output directory {str(path.parent)!r} does not exist; create it or choose another path")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write {str(path)!r}: {e.strerror}; choose a writable location") from None
