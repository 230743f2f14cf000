"""Fusion templates: one file each, with a pattern, a check (the refusal reason) and a merge."""

from .base import PHASES, FusionGroup, Match, Refusal, Template
from .concat import InPlaceConcat
from .eltwise import EltwiseEpilogue
from .horizontal import HorizontalConv
from .preactivation import PreActivation
from .registry import TemplateRegistry, default_registry
from .vertical import ConvChain

__all__ = [
    "PHASES",
    "ConvChain",
    "EltwiseEpilogue",
    "FusionGroup",
    "HorizontalConv",
    "InPlaceConcat",
    "Match",
    "PreActivation",
    "Refusal",
    "Template",
    "TemplateRegistry",
    "default_registry",
]
