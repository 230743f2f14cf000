"""The ordered registry of fusion templates.

Order is behaviour: the planner runs every template of the ``vertical`` phase in
registration order (giving the intermediate graph), then every template of the
``horizontal`` phase. Users add their own templates::

    from tvm_layerfuse.templates import default_registry
    registry = default_registry()
    registry.register(MyTemplate(), phase="horizontal", before="concat.in_place")
    plan = tvm_layerfuse.plan(graph, registry=registry)
"""

from __future__ import annotations

from typing import Iterator, Optional

from ..errors import TemplateError
from .base import PHASES, Template
from .concat import InPlaceConcat
from .eltwise import EltwiseEpilogue
from .horizontal import HorizontalConv
from .preactivation import PreActivation
from .vertical import ConvChain


class TemplateRegistry:
    """Templates by phase, in the order they run."""

    def __init__(self) -> None:
        self._phases: dict[str, list[Template]] = {p: [] for p in PHASES}

    def register(
        self,
        template: Template,
        *,
        phase: str,
        before: Optional[str] = None,
        after: Optional[str] = None,
    ) -> Template:
        """Add ``template`` to ``phase`` (at the end, or just before/after a named template)."""
        if phase not in self._phases:
            raise TemplateError(f"phase {phase!r} is unknown; expected one of {list(PHASES)}")
        for attr in ("name", "kind"):
            if not isinstance(getattr(template, attr, None), str):
                raise TemplateError(f"template {template!r} has no {attr!r} string; set it as a class attribute")
        for method in ("pattern", "check", "merge"):
            if not callable(getattr(template, method, None)):
                raise TemplateError(f"template {template.name!r} has no {method}() method")
        if template.name in self.names():
            raise TemplateError(f"a template named {template.name!r} is already registered; choose another name")
        if before is not None and after is not None:
            raise TemplateError("give at most one of before= and after=")
        items = self._phases[phase]
        anchor = before or after
        if anchor is None:
            items.append(template)
            return template
        names = [t.name for t in items]
        if anchor not in names:
            raise TemplateError(f"no template {anchor!r} in phase {phase!r}; expected one of {names}")
        items.insert(names.index(anchor) + (1 if after else 0), template)
        return template

    def unregister(self, name: str) -> None:
        for items in self._phases.values():
            for t in items:
                if t.name == name:
                    items.remove(t)
                    return
        raise TemplateError(f"no template named {name!r} is registered; expected one of {self.names()}")

    def phase(self, phase: str) -> list[Template]:
        return list(self._phases[phase])

    def names(self) -> list[str]:
        return [t.name for p in PHASES for t in self._phases[p]]

    def __iter__(self) -> Iterator[tuple[str, Template]]:
        for p in PHASES:
            for t in self._phases[p]:
                yield p, t


def default_registry() -> TemplateRegistry:
    """A fresh registry holding the built-in templates in their standard order."""
    r = TemplateRegistry()
    r.register(ConvChain(), phase="vertical")
    r.register(PreActivation(), phase="vertical")
    r.register(HorizontalConv(), phase="horizontal")
    r.register(EltwiseEpilogue(), phase="horizontal")
    r.register(InPlaceConcat(), phase="horizontal")
    return r
