"""Tactics: which implementation runs each conv layer of the fused model.

::

    --tactics auto     oneDNN where it is installed and the target is this machine's CPU kind
                       (x86_64 / aarch64 Linux, built here), TVM's kernels elsewhere; when
                       oneDNN is missing, one warning line and TVM's kernels
    --tactics onednn   oneDNN or fail (the reason and the install command)
    --tactics tvm      TVM's own kernels only

Within ``onednn``, each layer is chosen by the rule in :mod:`.use_onednn` (oneDNN when it
has an optimised kernel for the layer, else TVM; direct or Winograd convolution by timing). :func:`apply_tactics` returns the
rewritten module and a :class:`TacticPlan`: every layer's choice (for the manifest,
``inspect`` and the report) and the tactic library the artifact must carry.
"""

from __future__ import annotations

import logging
import platform
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from ...errors import BuildError, UsageError

log = logging.getLogger(__name__)

CHOICES = ("auto", "onednn", "tvm")


@dataclass
class TacticPlan:
    """What :func:`apply_tactics` decided."""

    requested: str
    used: str  # "onednn" | "tvm"
    layers: list = field(default_factory=list)  # LayerChoice
    library: Optional[Path] = None  # the extension .so the artifact carries
    note: str = ""  # why oneDNN is not used, when it is not
    version: str = ""  # oneDNN version
    winograd: str = "timed"  # how the conv algorithm was chosen (see use_onednn.WINOGRAD_CHOICES)
    block_width: int = 0  # the channel block of the blocked layout between oneDNN calls (0 plain, 8, 16)
    packing: Any = None  # prepack.PackReport: the conv calls whose weights the artifact holds packed
    tvm_layout: str = ""  # TVM's convs: "NCHW8c" etc. (relax/blocked_layout.py), "" plain NCHW
    blocked_convs: int = 0  # convs in that layout
    convs: int = 0  # all TVM convs

    def counts(self) -> dict[str, int]:
        return dict(Counter(c.tactic for c in self.layers))

    def manifest(self) -> dict[str, Any]:
        from . import abi, onednn

        libraries = []
        if self.library is not None:
            libraries.append(
                {
                    "file": onednn.LIBRARY_FILE,
                    "needs": [onednn.SONAME],
                    "install": onednn.INSTALL,
                    "built_against": onednn.installation().to_dict(),  # version, source, library path
                    "abi_version": abi.ABI_VERSION,  # the calling contract; checked at load
                }
            )
        return {
            "requested": self.requested,
            "used": self.used,
            "note": self.note,
            "onednn_version": self.version,
            "winograd": self.winograd,
            "block_width": self.block_width,
            "tvm_layout": self.tvm_layout,
            "blocked_convs": self.blocked_convs,
            "convs": self.convs,
            "counts": self.counts(),
            "layers": [c.to_dict() for c in self.layers],
            "libraries": libraries,
            "packed_weights": self.packing.to_dict() if self.packing is not None else None,
        }


def _machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def onednn_refusal(spec) -> Optional[str]:
    """Why the oneDNN tactic cannot serve target ``spec`` (None when it can)."""
    from . import onednn

    if spec.device != "cpu":
        return f"oneDNN serves CPU targets; {spec.preset} is {spec.device}"
    if spec.machine != _machine() or spec.cross_compiler:
        return f"target {spec.preset} is for {spec.machine} hosts, cross-compiled here; its oneDNN library would have to be built for it"
    return onednn.availability()


def apply_tactics(mod, params: Mapping[str, Any], spec, *, tactics: str = "auto", winograd: str = "timed"):
    """(module with the chosen layers calling the tactic library, :class:`TacticPlan`).

    ``winograd``: ``timed`` (both conv algorithms timed per layer, the faster kept), ``never``
    (direct only: the same kernels on every compile), ``always`` (Winograd wherever oneDNN has it)."""
    from .use_onednn import WINOGRAD_CHOICES

    if tactics not in CHOICES:
        raise UsageError(f"--tactics {tactics!r} is unknown; expected one of {', '.join(CHOICES)}")
    if winograd not in WINOGRAD_CHOICES:
        raise UsageError(f"--winograd {winograd!r} is unknown; expected one of {', '.join(WINOGRAD_CHOICES)}")
    if tactics == "tvm":
        return _blocked(mod, spec, TacticPlan(requested=tactics, used="tvm", note="--tactics tvm"))
    reason = onednn_refusal(spec)
    if reason is None:
        from . import onednn

        try:
            library = onednn.load()
        except BuildError as e:
            reason = str(e)
    if reason is not None:
        if tactics == "onednn":
            raise BuildError(f"--tactics onednn: {reason}")
        if spec.device == "cpu" and spec.machine == _machine() and not spec.cross_compiler:
            log.warning("oneDNN is not used, TVM kernels run every layer: %s", reason)
        return _blocked(mod, spec, TacticPlan(requested=tactics, used="tvm", note=reason))
    from .use_onednn import UseOneDNNConv

    rewrite = UseOneDNNConv(params=params, winograd=winograd)
    mod = rewrite(mod)
    used = any(c.tactic == "onednn" for c in rewrite.layers)
    plan = TacticPlan(
        requested=tactics,
        used="onednn" if used else "tvm",
        layers=list(rewrite.layers),
        library=library if used else None,
        note="" if used else "no layer suits oneDNN",
        version=onednn.version(),
        winograd=winograd,
        block_width=onednn.block_width() if used else 0,
    )
    return (mod, plan) if used else _blocked(mod, spec, plan)


def _blocked(mod, spec, plan: TacticPlan):
    """Where TVM runs every conv of a CPU target: the convs in NCHW[x]c, ``x`` the target's
    fp32 vector lanes (:mod:`...relax.blocked_layout`); (module, plan)."""
    if spec.device != "cpu":
        return mod, plan
    from ...relax.blocked_layout import BlockedConvLayout, blocked_layouts
    from ..schedules import CPUParams

    lanes = CPUParams.of(spec.tvm_target()).lanes
    layout = BlockedConvLayout(lanes)
    mod = layout(mod)
    plan.convs = layout.convs
    if layout.blocked:
        plan.tvm_layout, plan.blocked_convs = blocked_layouts(lanes)[0], layout.blocked
    return mod, plan


def format_tactics(info: Optional[Mapping[str, Any]]) -> str:
    """The per-layer tactic table of a manifest's ``tactics`` entry, for ``inspect``/reports."""
    if not info:
        return "tactics: not recorded"
    head = f"tactics: {info.get('used')} (requested {info.get('requested')})"
    if info.get("onednn_version"):
        head += f", oneDNN {info['onednn_version']}"
    if info.get("winograd") and info.get("used") == "onednn":
        head += f", Winograd: {info['winograd']}"
    if info.get("used") == "onednn" and "block_width" in info:
        b = info["block_width"]
        head += f", layout {'nChw%dc' % b if b else 'nchw (no blocked kernels on this CPU)'} between oneDNN calls"
    if info.get("used") == "tvm" and info.get("tvm_layout"):
        head += f", convs in {info['tvm_layout']} ({info.get('blocked_convs')} of {info.get('convs')})"
    if info.get("note"):
        head += f"; {info['note']}"
    lines = [head]
    packing = info.get("packed_weights")
    if packing:
        kept = packing.get("kept_plain") or []
        lines.append(
            f"  weights: {packing.get('packed_calls', 0)} oneDNN calls read theirs packed in their primitives' layouts "
            f"({packing.get('packed_bytes', 0) / 2**20:.1f} MiB), {len(kept)} calls plain"
            + (f" ({'; '.join(sorted({k['reason'] for k in kept}))})" if kept else "")
        )
    counts = info.get("counts") or {}
    if counts:
        lines.append("  " + ", ".join(f"{k}: {v} layers" for k, v in sorted(counts.items())))
    layers = info.get("layers") or []
    width = max([7, *(len(str(c.get("tactic", "?"))) for c in layers)])  # "onednn", "in-place", "read by prologues"
    for c in layers:
        detail = c.get("kernel") or c.get("reason") or ""
        if c.get("timing"):
            detail += f" ({c['timing']})"
        lines.append(f"  {c.get('layer', '?'):<40} {c.get('tactic', '?'):<{width}} {c.get('shape', ''):<32} {detail}")
    return "\n".join(lines)
