"""What a fusion template is: a pattern, a check that says why it refuses, and a merge.

A template is run by the planner on one topology graph at a time::

    for match in template.pattern(graph):      # candidate layer groups
        reason = template.check(graph, match)  # None: merge; a string: why not
        if reason is None:
            group = template.merge(graph, match)  # rewrites graph in place

``pattern`` looks only at op types and connections and may propose groups that ``check``
refuses; the refusal reasons go into the fusion report, so every candidate the user might
have expected to merge is accounted for.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Optional

from ..topology.graph import Layer, TopologyGraph

PHASES = ("vertical", "horizontal")
"""Merge order: every vertical template first (giving the intermediate graph), then the
horizontal phase (horizontal, concat and element-wise templates)."""


@dataclass
class Match:
    """A candidate group found by a template's pattern.

    ``layers`` are layer names in the graph the pattern ran on, anchor first; ``info``
    carries what the pattern learnt (roles of the layers, why a chain stopped, ...).
    """

    template: str
    layers: list[str]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class FusionGroup:
    """One merge the planner carried out."""

    id: int
    template: str
    kind: str  # vertical | horizontal | concat | eltwise
    phase: str  # vertical | horizontal
    members: list[str]  # original layers (of the first topology graph) the group covers
    layer: str  # the resulting layer's name in the second topology graph
    layers_before: int  # layers of the graph the template ran on that the group replaced
    layers_after: int  # layers that replaced them
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "template": self.template,
            "kind": self.kind,
            "phase": self.phase,
            "members": list(self.members),
            "layer": self.layer,
            "layers_before": self.layers_before,
            "layers_after": self.layers_after,
            "details": self.details,
        }


@dataclass
class Refusal:
    """A candidate merge that was refused, with the reason: by a template's check on the
    topology graph, or by a pass on the IRModule (``function``: the Relax function, and
    ``layers`` the variables there)."""

    template: str  # the template or pass that refused it
    kind: str  # vertical | horizontal | concat | eltwise
    layers: list[str]
    reason: str
    function: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        out = {"template": self.template, "kind": self.kind, "layers": list(self.layers), "reason": self.reason}
        if self.function is not None:
            out["function"] = self.function
        return out


class Template(abc.ABC):
    """Base class of fusion templates. Subclasses set ``name`` and ``kind``."""

    name: ClassVar[str]
    kind: ClassVar[str]
    description: ClassVar[str] = ""

    @abc.abstractmethod
    def pattern(self, graph: TopologyGraph) -> Iterator[Match]:
        """Yield candidate groups (op types and connections only)."""

    @abc.abstractmethod
    def check(self, graph: TopologyGraph, match: Match) -> Optional[str]:
        """Return why the candidate cannot merge, or None when it can."""

    @abc.abstractmethod
    def merge(self, graph: TopologyGraph, match: Match) -> tuple[Layer, dict[str, Any]]:
        """Rewrite ``graph`` in place; return the resulting layer and the group's details."""

    def __repr__(self) -> str:
        return f"<template {self.name} ({self.kind})>"


def members_of(graph: TopologyGraph, names: list[str]) -> tuple[str, ...]:
    """The original layers behind the named layers, in order, without repeats."""
    seen: dict[str, None] = {}
    for n in names:
        for m in graph.layer(n).members:
            seen.setdefault(m, None)
    return tuple(seen)
