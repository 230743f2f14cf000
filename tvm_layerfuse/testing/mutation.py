"""Deliberate bugs inserted into a model: the test of the numeric tests.

A numeric check that cannot fail is worse than none. :func:`mutants` inserts, by ONNX graph
surgery, the kind of error a wrong fusion makes, at an early, a middle and a late
activation of a model:

* ``scale``        the tensor times 1.01 (an epilogue applied with a wrong constant);
* ``zero_channel`` one channel set to 0 (a lost or misplaced concat slice / conv output);
* ``zero_row``     one row (H index) set to 0 (a wrong offset or a short loop).

Each bug is one ``Mul`` by a constant inserted after the tensor's producer, the tensor's
readers re-pointed to the product. The channel and the row are the ones with the largest
magnitude on the given input (a dead channel or row zeroed would change nothing, and a
check that passes it would be right). :func:`mutation_errors` reports the error each bug
gives under the project's comparison (:func:`~.checks.output_mismatches`): every one must
be a failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

KINDS = ("scale", "zero_channel", "zero_row")
SITES = ("early", "middle", "late")
AFTER_ACTIVATION = ("Relu", "Clip", "LeakyRelu", "Sigmoid", "Concat", "Sum", "Add", "MaxPool", "AveragePool", "LRN")


@dataclass(frozen=True)
class Mutant:
    """One inserted bug: what, where (the tensor and its position) and the model carrying it."""

    kind: str
    site: str
    tensor: str
    detail: str
    model: onnx.ModelProto


def activation_sites(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> dict[str, str]:
    """An early, a middle and a late 4-D activation (node output, not a graph output, with
    values in ``values``), by position in node order. Outputs of activations, pools, concats
    and sums are preferred: a channel zeroed before a Relu that would have zeroed it anyway
    is no bug."""
    declared = {o.name for o in model.graph.output}
    candidates = [
        (n.op_type, o)
        for n in model.graph.node
        for o in n.output[:1]
        if o and o not in declared and np.ndim(values.get(o)) == 4 and np.shape(values[o])[2] > 1
    ]
    acts = [o for op, o in candidates if op in AFTER_ACTIVATION] or [o for _, o in candidates]
    if not acts:
        raise ValueError(f"model {model.graph.name!r} has no 4-D activation to mutate")
    picks = (acts[len(acts) // 10], acts[len(acts) // 2], acts[-1])
    return dict(zip(SITES, picks))


def _insert_mul(model: onnx.ModelProto, tensor: str, factor: np.ndarray, tag: str) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    mutated = f"{tensor}__{tag}"
    const = f"{tensor}__{tag}_factor"
    for node in m.graph.node:
        for k, i in enumerate(node.input):
            if i == tensor:
                node.input[k] = mutated
    pos = next(k for k, n in enumerate(m.graph.node) if tensor in n.output)
    m.graph.node.insert(pos + 1, helper.make_node("Mul", [tensor, const], [mutated], name=f"{tag}_{tensor}"))
    m.graph.initializer.append(numpy_helper.from_array(factor.astype(np.float32), const))
    return m


def mutate(model: onnx.ModelProto, tensor: str, kind: str, value: np.ndarray) -> tuple[onnx.ModelProto, str]:
    """``model`` with bug ``kind`` on ``tensor`` (its value on the test input: ``value``,
    ``[N, C, H, W]``), and a one-line description of the bug."""
    n, c, h, w = value.shape
    energy = np.abs(value.astype(np.float64))
    if kind == "scale":
        return _insert_mul(model, tensor, np.array(1.01), "scaled"), f"{tensor} x 1.01"
    if kind == "zero_channel":
        ch = int(energy.sum(axis=(0, 2, 3)).argmax())
        mask = np.ones((1, c, 1, 1))  # [1, C, 1, 1]
        mask[0, ch] = 0.0
        return _insert_mul(model, tensor, mask, "zeroed_channel"), f"{tensor} channel {ch} of {c} zeroed"
    if kind == "zero_row":
        row = int(energy.sum(axis=(0, 1, 3)).argmax())
        mask = np.ones((1, 1, h, 1))  # [1, 1, H, 1]
        mask[0, 0, row] = 0.0
        return _insert_mul(model, tensor, mask, "zeroed_row"), f"{tensor} row {row} of {h} zeroed"
    raise ValueError(f"unknown mutation {kind!r}; expected one of {KINDS}")


def mutants(model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, kinds=KINDS, sites=SITES) -> list[Mutant]:
    """Every bug of ``kinds`` at every site of ``sites`` (see :func:`activation_sites`)."""
    from .differential import run_reference

    _, values = run_reference(model, feeds)
    where = activation_sites(model, values)
    out = []
    for site in sites:
        for kind in kinds:
            m, detail = mutate(model, where[site], kind, values[where[site]])
            out.append(Mutant(kind=kind, site=site, tensor=where[site], detail=detail, model=m))
    return out


def mutation_errors(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, logits: bool = True, kinds=KINDS, sites=SITES
) -> list[tuple[Mutant, float, Optional[list[str]]]]:
    """For each mutant of ``model``: the worst relative error of its outputs against the
    unmutated model (onnxruntime both), and the mismatches the comparison reports.
    ``logits=False`` compares the declared outputs only (a saturated softmax included)."""
    from .checks import output_mismatches, run_onnxruntime, worst_error
    from .weights import with_logits

    base = with_logits(model) if logits else model
    expected = run_onnxruntime(base, feeds)
    names = [o.name for o in base.graph.output]
    rows = []
    for mutant in mutants(model, feeds, kinds=kinds, sites=sites):
        m = with_logits(mutant.model) if logits else mutant.model
        got = run_onnxruntime(m, feeds)
        rows.append((mutant, worst_error(expected, got), output_mismatches(expected, got, names=names)))
    return rows
