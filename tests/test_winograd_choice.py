"""The oneDNN tactic's conv algorithm choice with the timings injected, so that the answer
does not depend on this machine (nor on whether its oneDNN has a Winograd kernel at all:
oneDNN 2.6 has one for AVX-512 only). Winograd is kept exactly when it is at least 5 %
faster than the direct conv (``WINOGRAD_GAIN``, as the README states it); both directions and both sides of the
threshold are checked, on the layer record (kernel, timing text) and on the call the
compiled model makes (its algorithm attribute)."""

from __future__ import annotations

import pytest
from tvm import relax

from graphs import Net
from tvm_layerfuse.compile.tactics import abi, onednn, oracle, use_onednn
from tvm_layerfuse.compile.tactics.use_onednn import UseOneDNNConv
from tvm_layerfuse.relax.pipeline import fuse_with_report

MISSING = onednn.availability()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"oneDNN is not installed here: {MISSING}")
INJECTED_KERNEL = "jit_wino_injected"


def _model():
    """One 3x3 stride-1 conv (Winograd applies) and one 1x1 (it does not); 8 channels keep
    the plain layout, so the kernel names recorded are the ones the choice made."""
    n = Net(seed=31)
    x = n.input("x", (1, 8, 12, 12))
    y = n.relu(n.conv(x, 8, k=3, name="c3"))
    return n.build([n.relu(n.conv(y, 8, k=1, name="c1"))])


def _conv_algorithms(mod) -> list[int]:
    """The algorithm attribute of every oneDNN conv call (ConvAttrs.algorithm: 0 direct, 1 Winograd)."""
    found = []

    def visit(e):
        bound = abi.parse_call(e)
        if bound is not None and bound.call.conv:
            found.append(bound.attrs.algorithm)

    for _, func in mod.functions.items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return found


@pytest.fixture(scope="module")
def fused():
    return fuse_with_report(_model(), bind=True).mod


def _inject(monkeypatch, holder, kernel_for, timings_for):
    """The library's answers replaced: ``kernel_for(attrs, real kernel)`` names the kernel,
    ``timings_for(attrs_b)`` gives (direct ms, Winograd ms); each timing asked for is recorded
    in ``holder.calls`` as (x shape, w shape, algorithm a, algorithm b)."""
    real = onednn.implementation
    holder.calls = []

    def implementation(x_shape, w_shape, attrs, *, residual):
        return kernel_for(attrs, real(x_shape, w_shape, attrs, residual=residual))

    def time_conv(x_shape, w_shape, attrs_a, attrs_b, *, residual, reps=7, threads=1):
        holder.calls.append((list(x_shape), list(w_shape), attrs_a.algorithm, attrs_b.algorithm, threads))
        timings = timings_for(attrs_b)
        return timings.get(threads, timings[1]) if isinstance(timings, dict) else timings

    monkeypatch.setattr(onednn, "implementation", implementation)
    monkeypatch.setattr(onednn, "time_conv", time_conv)
    monkeypatch.setattr(oracle, "_TIMINGS", {})  # the process's timing cache: empty for the injected answers
    return holder


@pytest.fixture(autouse=True)
def one_thread_count(monkeypatch):
    """The choice timed at one thread only, whatever this machine's count (the test that times
    two counts sets them itself)."""
    monkeypatch.setattr(use_onednn, "timing_threads", lambda: (1,))


@pytest.fixture
def injected(monkeypatch):
    """oneDNN answers as if it had a Winograd kernel (whether this CPU's has one or not), named
    ``INJECTED_KERNEL``; ``timings`` = (direct ms, Winograd ms)."""
    return _inject(
        monkeypatch,
        injected,
        lambda attrs, kernel: INJECTED_KERNEL if attrs.algorithm == abi.CONV_ALGORITHMS["winograd"] else _not_own(kernel),
        lambda attrs: injected.timings,
    )


def _not_own(kernel: str) -> str:
    """The kernel, except that the library's Winograd (which fits these 8 channels on AVX2)
    answers as a layer it does not fit would: only oneDNN's algorithms are in the choice."""
    return "jit:direct_injected" if abi.is_own_winograd(kernel) else kernel


@pytest.mark.parametrize(
    "direct_ms, wino_ms, winograd",
    [
        (2.0, 1.0, True),  # twice as fast: Winograd
        (1.0, 2.0, False),  # twice as slow: direct
        (1.05, 1.0, True),  # exactly the required gain: 5 % (README, --winograd timed)
        (1.04, 1.0, False),  # faster, but by less than 5 %
    ],
)
def test_winograd_is_kept_exactly_when_it_is_faster_by_the_gain(fused, injected, direct_ms, wino_ms, winograd):
    injected.timings = (direct_ms, wino_ms)
    chooser = UseOneDNNConv(winograd="timed")
    mod = chooser(fused)
    convs = [c for c in chooser.layers if c.tactic == "onednn" and not c.layer.startswith(("pool:", "dense:", "concat:"))]
    assert len(convs) == 2, chooser.layers
    three, one = sorted(convs, key=lambda c: c.shape.endswith("3, 3]"), reverse=True)
    assert [c[:2] for c in injected.calls] == [([1, 8, 12, 12], [8, 8, 3, 3])]  # only the 3x3 conv is timed, once
    assert three.timing == f"direct {direct_ms:.3f} ms, winograd {wino_ms:.3f} ms"
    assert (three.kernel == INJECTED_KERNEL) is winograd, three
    assert one.kernel != INJECTED_KERNEL and not one.timing, one
    assert sorted(_conv_algorithms(mod)) == ([0, 1] if winograd else [0, 0])


def test_a_layer_shape_is_timed_once_per_process(fused, injected):
    """The timing cache: a second compile of the same layers in the process makes the same
    choice from the first one's timings, without timing the conv again."""
    injected.timings = (2.0, 1.0)
    first, second = UseOneDNNConv(winograd="timed"), UseOneDNNConv(winograd="timed")
    assert sorted(_conv_algorithms(first(fused))) == sorted(_conv_algorithms(second(fused))) == [0, 1]
    assert len(injected.calls) == 1
    assert [c.timing for c in first.layers] == [c.timing for c in second.layers]


@pytest.mark.parametrize(
    "one, two, winograd",
    [
        ((4.9, 5.3), (2.4, 1.2), True),  # 8 % slower at one thread, twice as fast at two: Winograd
        ((2.0, 1.0), (1.0, 1.9), False),  # twice as fast at one thread, 1.9x as slow at two: direct
        ((1.0, 1.0), (1.1025, 1.0), True),  # the mean gain exactly 5 %
        ((1.0, 1.0), (1.1, 1.0), False),  # 4.9 %
    ],
)
def test_winograd_is_chosen_over_both_thread_counts(fused, injected, monkeypatch, one, two, winograd):
    """Where the machine has more than one thread, each algorithm is timed at one thread and at
    its count (oneDNN 2.6 makes other kernels for another count: on AVX-512 a 3x3 32 -> 64 conv
    on 147x147 runs Winograd 4x3, 8 % slower than direct, at one thread and Winograd 2x3, twice
    as fast, at two), and Winograd is kept where the geometric mean of its time over the direct
    conv's is at least ``WINOGRAD_GAIN`` better; the layer's timing text gives both."""
    monkeypatch.setattr(use_onednn, "timing_threads", lambda: (1, 2))
    injected.timings = {1: one, 2: two}
    chooser = UseOneDNNConv(winograd="timed")
    mod = chooser(fused)
    assert [(c[:2], c[4]) for c in injected.calls] == [(([1, 8, 12, 12], [8, 8, 3, 3]), 1), (([1, 8, 12, 12], [8, 8, 3, 3]), 2)]
    (three,) = [c for c in chooser.layers if c.timing]
    assert three.timing == (
        f"direct {one[0]:.3f} ms, winograd {one[1]:.3f} ms; direct {two[0]:.3f} ms, winograd {two[1]:.3f} ms at 2 threads"
    )
    assert (three.kernel == INJECTED_KERNEL) is winograd, three
    assert sorted(_conv_algorithms(mod)) == ([0, 1] if winograd else [0, 0])


def test_the_timing_threads_are_one_and_the_machines_count(monkeypatch):
    monkeypatch.undo()  # the real function, not the autouse fixture's
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert use_onednn.timing_threads() == (1, 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert use_onednn.timing_threads() == (1,)
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    import os

    cpus = len(os.sched_getaffinity(0))
    assert use_onednn.timing_threads() == ((1, cpus) if cpus > 1 else (1,))


@pytest.mark.parametrize("mode, winograd", [("never", False), ("always", True)])
def test_fixed_modes_ignore_the_timings(fused, injected, mode, winograd):
    injected.timings = (1.0, 2.0) if winograd else (2.0, 1.0)  # the opposite of the mode's answer
    chooser = UseOneDNNConv(winograd=mode)
    mod = chooser(fused)
    assert not injected.calls
    assert sorted(_conv_algorithms(mod)) == ([0, 1] if winograd else [0, 0])
    assert any(c.kernel == INJECTED_KERNEL for c in chooser.layers) is winograd


OWN_2x2, OWN_4x4 = "winograd_2x2_3x3" + abi.OWN_WINOGRAD_SUFFIXES[8], "winograd_4x4_3x3" + abi.OWN_WINOGRAD_SUFFIXES[8]


@pytest.fixture
def own_only(monkeypatch):
    """oneDNN answers as on AVX2 (no Winograd kernel) and both of the library's 3x3 forms fit;
    ``timings`` = {algorithm: (direct ms, Winograd ms)}."""
    own = {abi.CONV_ALGORITHMS["own_winograd"]: OWN_2x2, abi.CONV_ALGORITHMS["own_winograd_4x4"]: OWN_4x4}

    def kernel_for(attrs, kernel):
        if attrs.algorithm == abi.CONV_ALGORITHMS["winograd"]:
            return "unsupported: no Winograd kernel here"
        return own.get(attrs.algorithm, kernel)

    return _inject(monkeypatch, own_only, kernel_for, lambda attrs: own_only.timings[attrs.algorithm])


@pytest.mark.parametrize(
    "tile2_ms, tile4_ms, chosen",
    [
        (1.0, 1.5, 2),  # tiles of 2 fastest
        (1.5, 0.8, 3),  # tiles of 4 fastest
        (1.0, 1.02, 0),  # neither faster than direct (1.04 ms) by the gain
    ],
)
def test_without_a_onednn_winograd_kernel_the_fastest_library_form_is_kept_by_the_same_rule(
    fused, own_only, tile2_ms, tile4_ms, chosen
):
    direct_ms = 1.04 if not chosen else 2.0
    own_only.timings = {2: (direct_ms, tile2_ms), 3: (direct_ms, tile4_ms)}
    chooser = UseOneDNNConv(winograd="timed")
    mod = chooser(fused)
    assert [c[2:4] for c in own_only.calls] == [(0, 2), (0, 3)]  # the 3x3 conv: direct against each of the library's forms
    three = next(c for c in chooser.layers if c.shape.endswith("3, 3]"))
    assert three.kernel == {2: OWN_2x2, 3: OWN_4x4}.get(chosen, three.kernel) and abi.is_own_winograd(three.kernel) is bool(chosen)
    assert three.timing == f"direct {direct_ms:.3f} ms, winograd {min(tile2_ms, tile4_ms):.3f} ms"
    assert sorted(_conv_algorithms(mod)) == sorted([0, chosen])



@pytest.fixture
def both(monkeypatch):
    """oneDNN answers as on AVX-512 (its Winograd kernel, ``INJECTED_KERNEL``) and both of the
    library's 3x3 forms fit too (as they do there, on nChw16c); ``timings`` = {algorithm:
    (direct ms, Winograd ms)}."""
    named = {
        abi.CONV_ALGORITHMS["winograd"]: INJECTED_KERNEL,
        abi.CONV_ALGORITHMS["own_winograd"]: OWN_2x2,
        abi.CONV_ALGORITHMS["own_winograd_4x4"]: OWN_4x4,
    }
    return _inject(monkeypatch, both, lambda attrs, kernel: named.get(attrs.algorithm, kernel), lambda attrs: both.timings[attrs.algorithm])


@pytest.mark.parametrize(
    "onednn_ms, tile2_ms, chosen",
    [
        (1.5, 0.5, 2),  # the library's tiles of 2 fastest
        (0.5, 1.5, 1),  # oneDNN's fastest
    ],
)
def test_beside_a_onednn_winograd_kernel_the_library_tiles_of_2_are_timed_its_4x4_not(fused, both, onednn_ms, tile2_ms, chosen):
    """Where oneDNN has a 3x3 Winograd kernel, it and the library's F(2x2, 3x3) are timed
    against the direct conv, and the faster kept; the library's F(4x4, 3x3) is not timed, even
    were it faster (it rounds further from the exact sum than oneDNN's)."""
    both.timings = {1: (2.0, onednn_ms), 2: (2.0, tile2_ms), 3: (2.0, 0.1)}
    chooser = UseOneDNNConv(winograd="timed")
    mod = chooser(fused)
    assert [c[2:4] for c in both.calls] == [(0, 1), (0, 2)]
    three = next(c for c in chooser.layers if c.shape.endswith("3, 3]"))
    assert three.kernel == {1: INJECTED_KERNEL, 2: OWN_2x2}[chosen]
    assert three.timing == f"direct 2.000 ms, winograd {min(onednn_ms, tile2_ms):.3f} ms"
    assert sorted(_conv_algorithms(mod)) == [0, chosen]
