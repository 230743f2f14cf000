"""The ordered template registry, and a user's own template taking part in planning."""

from typing import Iterator, Optional

import pytest

from graphs import Net, assert_realizes
from tvm_layerfuse.errors import TemplateError
from tvm_layerfuse.planner import plan
from tvm_layerfuse.templates import Match, Template, default_registry
from tvm_layerfuse.topology.graph import Layer, TopologyGraph


class DropoutRemoval(Template):
    """Dropout in inference is the identity: the layer disappears (its consumers read its input)."""

    name = "user.drop_dropout"
    kind = "vertical"

    def pattern(self, graph: TopologyGraph) -> Iterator[Match]:
        for layer in graph:
            if layer.op_type == "Dropout":
                yield Match(self.name, [layer.name])

    def check(self, graph: TopologyGraph, match: Match) -> Optional[str]:
        layer = graph.layer(match.layers[0])
        if len(layer.outputs) > 1:
            return "the mask output is used"
        if graph.tensor(layer.outputs[0]).is_output:
            return "its output is a graph output"
        return None

    def merge(self, graph: TopologyGraph, match: Match):
        layer = graph.layer(match.layers[0])
        src = graph.producer(layer.inputs[0])
        for c in graph.consumers(layer.outputs[0]):
            c.inputs = [layer.inputs[0] if i == layer.outputs[0] else i for i in c.inputs]
        merged = Layer(
            name=src.name,
            op_type=src.op_type,
            inputs=src.inputs,
            outputs=src.outputs,
            attrs=src.attrs,
            members=src.members + layer.members,
            template=self.name,
            fused=src.fused,
        )
        graph.replace([src.name, layer.name], [merged])
        return merged, {"removed": layer.name}


def test_default_order():
    assert default_registry().names() == [
        "vertical.conv_chain",
        "vertical.preactivation",
        "horizontal.parallel_conv",
        "eltwise.conv_epilogue",
        "concat.in_place",
    ]


def test_user_template_runs_in_its_phase():
    n = Net(seed=1)
    x = n.input("x", (1, 3, 6, 6))
    y = n.node("Dropout", [n.maxpool(x)], name="drop")
    model = n.build([n.relu(n.conv(y, 4, name="c"))])
    registry = default_registry()
    registry.register(DropoutRemoval(), phase="vertical", before="vertical.conv_chain")
    p = assert_realizes(model, plan(model, registry=registry))
    (g,) = p.groups_of("user.drop_dropout")
    assert g.details == {"removed": "drop"}
    assert registry.names()[0] == "user.drop_dropout"
    assert "drop" not in [l.name for l in p.second]


def test_registry_refuses_malformed_use():
    r = default_registry()
    with pytest.raises(TemplateError, match="already registered"):
        r.register(DropoutRemoval(), phase="vertical") and r.register(DropoutRemoval(), phase="vertical")
    with pytest.raises(TemplateError, match="phase 'sideways' is unknown"):
        r.register(DropoutRemoval(), phase="sideways")
    with pytest.raises(TemplateError, match="no template 'nope'"):
        default_registry().register(DropoutRemoval(), phase="vertical", after="nope")
    r.unregister("concat.in_place")
    assert "concat.in_place" not in r.names()
    with pytest.raises(TemplateError, match="no template named"):
        r.unregister("concat.in_place")


def test_unregistering_a_template_turns_it_off():
    from tvm_layerfuse.models import light_model

    r = default_registry()
    r.unregister("horizontal.parallel_conv")
    p = plan(light_model("inception_v1"), registry=r)
    assert not p.groups_of("horizontal") and len(p.groups_of("concat")) == 9
