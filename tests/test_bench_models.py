"""scripts/bench_models.py: the column against the faster engine takes the anchor with the
lower median, and calls a model ahead or behind only where every round agrees."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_models", ROOT / "scripts" / "bench_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "ours, theirs, want",
    [
        ([1.0, 1.1, 1.2], [1.3, 1.4, 1.5], "ahead"),
        ([1.3, 1.4, 1.5], [1.0, 1.1, 1.2], "behind"),
        ([1.0, 1.4, 1.2], [1.3, 1.35, 1.5], "tie"),  # the lower median, but one slow round overlaps
        ([1.0, 1.2], [1.2, 1.3], "tie"),  # touching spreads are not separated
        ([1.3, 1.5], [1.0, 1.3], "tie"),
    ],
)
def test_verdict_separates_only_disjoint_spreads(ours, theirs, want):
    assert _bench().verdict(ours, theirs) == want


def test_against_faster_takes_the_anchor_with_the_lower_median():
    bench = _bench()
    ours = [2.0, 2.1, 2.2]
    # onnxruntime has the lowest single round, OpenVINO the lower median: OpenVINO is the anchor
    anchors = {"onnxruntime": [1.5, 2.6, 2.7], "openvino": [2.3, 2.4, 2.5]}
    assert bench.against_faster(ours, anchors) == f"{2.1 / 2.4:.2f} ahead"
    assert bench.against_faster(ours, {"onnxruntime": [1.9, 2.0, 2.05]}) == f"{2.1 / 2.0:.2f} tie"
