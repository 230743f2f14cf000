"""The planner: run the templates in order and produce the fusion plan.

::

    first graph ──vertical templates──► intermediate graph ──horizontal phase──► second graph
                  (conv chains, pre-activation)             (horizontal, element-wise, concat)

Each template proposes candidates (``pattern``), the planner asks ``check`` for a refusal
reason, and on None lets ``merge`` rewrite the graph. A candidate whose layers a previous
merge of the same template changed is proposed again by re-running the pattern. The
result is deterministic: templates run in registry order and patterns in graph order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from .errors import GraphError
from .templates.base import PHASES, FusionGroup, Refusal, Template, members_of
from .templates.registry import TemplateRegistry, default_registry
from .topology.graph import TopologyGraph
from .topology.onnx_reader import ModelSource, read_onnx

log = logging.getLogger(__name__)

TVM_CONVERTERS_VERSION = "0.27"
TVM_UNSUPPORTED_ONNX_OPS = frozenset(
    """Bernoulli BitCast BlackmanWindow CausalConvWithState Celu CenterCropPad Col2Im ConvInteger CumProd DFT
    DeformConv Det GRU HammingWindow HannWindow If ImageDecoder LSTM LinearAttention Loop LpNormalization
    MelWeightMatrix Multinomial NegativeLogLikelihoodLoss QLinearConv QLinearMatMul RNN RandomNormal
    RandomNormalLike RandomUniform RandomUniformLike RegexFullMatch ReverseSequence RotaryEmbedding STFT Scan
    SequenceMap SoftmaxCrossEntropyLoss StringConcat StringNormalizer StringSplit SwiGLU Swish TensorScatter
    TfIdfVectorizer""".split()
)
"""Default-domain ONNX ops without a converter in ``tvm.relax.frontend.onnx`` of TVM 0.27.

Kept as data so that ``inspect`` can say so without importing TVM (seconds); a test
compares it with the installed TVM's converter map, so a TVM upgrade that adds or drops
converters shows up as a failing test, not as a stale note."""


CONSTANT_FILL_NOTE = "weights are constant fills"


def constant_fill_note(weights: int) -> str:
    """The note for a model whose every Conv/Gemm weight is one value repeated."""
    return (
        f"{CONSTANT_FILL_NOTE}: all {weights} Conv/Gemm weights hold one value each (ConstantOfShape), as the "
        "onnx package ships its model-zoo networks without trained weights; every input gives (nearly) the same "
        "output, so a classifier shows every class at the same probability (1/1000 = 0.0010) - this is expected, "
        "not a compile error; compile a trained model to see real classes"
    )


def tvm_unsupported_layers(graph: TopologyGraph) -> list[tuple[str, str]]:
    """``(layer name, op type)`` of the default-domain layers TVM's ONNX importer cannot convert."""
    return [(l.name, l.op_type) for l in graph if not l.domain and l.op_type in TVM_UNSUPPORTED_ONNX_OPS]


@dataclass
class FusionPlan:
    """What to merge: the groups, the refused candidates, and the three graphs."""

    model: str
    first: TopologyGraph
    intermediate: TopologyGraph
    second: TopologyGraph
    groups: list[FusionGroup] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    templates: list[str] = field(default_factory=list)

    def groups_of(self, template_or_kind: str) -> list[FusionGroup]:
        return [g for g in self.groups if template_or_kind in (g.template, g.kind)]

    def refusals_of(self, template_or_kind: str) -> list[Refusal]:
        return [r for r in self.refusals if template_or_kind in (r.template, r.kind)]

    def counts(self) -> dict[str, Any]:
        """Headline numbers of the plan."""
        in_place = [l for l in self.second if l.fused.in_place]
        return {
            "layers_first": len(self.first),
            "layers_intermediate": len(self.intermediate),
            "layers_second": len(self.second),
            "kernels_second": len(self.second) - len(in_place),
            "groups": len(self.groups),
            "vertical": len(self.groups_of("vertical")),
            "horizontal": len(self.groups_of("horizontal")),
            "eltwise": len(self.groups_of("eltwise")),
            "concat_in_place": len(self.groups_of("concat")),
            "refused": len(self.refusals),
        }

    def graph_notes(self) -> list[str]:
        """Facts about the model that limit fusion or compilation (ops ONNX does not define,
        ops TVM's importer cannot convert, weights holding NaN/Inf)."""
        notes = []
        folding = self.first.meta.get("shape_folding")
        if folding:
            from .topology.shape_folding import ShapeFolding

            notes.append(ShapeFolding(**folding).summary())
        filled = self.first.meta.get("constant_fill_weights")
        if filled:
            notes.append(constant_fill_note(filled["weights"]))
        unknown = self.first.meta.get("unknown_ops", [])
        if unknown:
            notes.append(f"ops ONNX does not define are kept as opaque layers, never fused: {', '.join(unknown)}")
        missing = tvm_unsupported_layers(self.first)
        if missing:
            ops = sorted({op for _, op in missing})
            layers = ", ".join(repr(name) for name, _ in missing[:3]) + (" ..." if len(missing) > 3 else "")
            notes.append(
                f"TVM {TVM_CONVERTERS_VERSION}'s ONNX importer has no converter for {', '.join(ops)} (layers {layers}); "
                "`compile` will refuse this model - replace those ops or register a converter in "
                "tvm.relax.frontend.onnx"
            )
        nonfinite = self.first.meta.get("nonfinite_constants", [])
        if nonfinite:
            shown = ", ".join(f"{e['name']!r} ({e['count']} of {e['size']} values)" for e in nonfinite[:3])
            more = f" and {len(nonfinite) - 3} more" if len(nonfinite) > 3 else ""
            notes.append(
                f"weights hold NaN/Inf values: {shown}{more}; outputs they reach become NaN/Inf, or are "
                "silently clamped where a Relu/Clip follows (TVM's max/min drop NaN, onnxruntime keeps it) - "
                "check the training run or the export"
            )
        return notes

    def to_dict(self, *, graphs: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "templates": list(self.templates),
            "counts": self.counts(),
            "groups": [g.to_dict() for g in self.groups],
            "refusals": [r.to_dict() for r in self.refusals],
            "notes": self.graph_notes(),
        }
        if self.first.meta.get("shape_folding"):
            out["shape_folding"] = self.first.meta["shape_folding"]
        if graphs:
            out["first_graph"] = self.first.to_dict()
            out["second_graph"] = self.second.to_dict()
        return out


def plan(
    model: Union[ModelSource, TopologyGraph],
    *,
    registry: Optional[TemplateRegistry] = None,
    input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
) -> FusionPlan:
    """Plan the merges of ``model`` (a path, an ``onnx.ModelProto`` or a first topology graph)."""
    first = model if isinstance(model, TopologyGraph) else read_onnx(model, input_shapes=input_shapes)
    registry = registry or default_registry()
    graph = first.copy()
    groups: list[FusionGroup] = []
    refusals: list[Refusal] = []
    intermediate = graph
    for phase in PHASES:
        for template in registry.phase(phase):
            _run_template(graph, template, phase, groups, refusals)
        if phase == "vertical":
            intermediate = graph.copy()
    result = FusionPlan(
        model=first.name,
        first=first,
        intermediate=intermediate,
        second=graph,
        groups=groups,
        refusals=refusals,
        templates=registry.names(),
    )
    validate(result)
    log.info("plan for %s: %s", first.name, result.counts())
    return result


def _run_template(
    graph: TopologyGraph,
    template: Template,
    phase: str,
    groups: list[FusionGroup],
    refusals: list[Refusal],
) -> None:
    decided: set[tuple[str, ...]] = set()
    while True:
        stale = False
        for match in _matches_with_snapshots(template, graph, decided):
            if any(n not in graph or graph.layer(n) is not layer for n, layer in match.info["_snapshot"].items()):
                stale = True  # an earlier merge changed these layers: propose again
                continue
            decided.add(tuple(match.layers))
            reason = template.check(graph, match)
            if reason is not None:
                refusals.append(Refusal(template.name, template.kind, list(match.layers), reason))
                log.debug("%s refused %s: %s", template.name, match.layers, reason)
                continue
            size_before = len(graph)
            layer, details = template.merge(graph, match)
            removed = size_before - len(graph)
            group = FusionGroup(
                id=len(groups),
                template=template.name,
                kind=template.kind,
                phase=phase,
                members=list(members_of(graph, match.layers)) if template.kind == "concat" else list(layer.members),
                layer=layer.name,
                layers_before=len(set(match.layers)),
                layers_after=len(set(match.layers)) - removed,
                details=details,
            )
            groups.append(group)
        if not stale:
            return


def _matches_with_snapshots(template: Template, graph: TopologyGraph, decided: set[tuple[str, ...]]):
    """The pattern's candidates not yet decided, each with a snapshot of its layers."""
    matches = [m for m in template.pattern(graph) if tuple(m.layers) not in decided]
    for m in matches:
        m.info["_snapshot"] = {n: graph.layer(n) for n in m.layers}
    return matches


def validate(p: FusionPlan) -> None:
    """Invariants of a plan: every original layer appears exactly once in the second graph,
    every tensor a layer reads is defined, and the second graph is acyclic."""
    seen: dict[str, str] = {}
    for layer in p.second:
        for m in layer.members:
            if m in seen:
                raise GraphError(f"plan error: layer {m!r} is in both {seen[m]!r} and {layer.name!r}")
            seen[m] = layer.name
    missing = [l.name for l in p.first if l.name not in seen]
    extra = [m for m in seen if m not in p.first]
    if missing or extra:
        raise GraphError(f"plan error: layers lost {missing[:5]} or invented {extra[:5]} by the merges")
    p.second.relink()
    p.second.sort()
    for o in p.second.outputs:
        t = p.second.tensor(o)
        if t.producer is None and not t.is_input and not t.constant:
            raise GraphError(f"plan error: graph output {o!r} is no longer produced")
