"""Random *valid* CNN graphs for differential fuzzing of the planner and the compiler.

Two front ends over one generator:

* :func:`cnn_graphs` - a hypothesis strategy; every structural choice is a hypothesis
  draw, so a failing graph shrinks towards fewer, simpler blocks. Yields a :class:`CNNCase`
  (``model``, ``feeds``), unpackable as ``model, feeds``.
* :func:`random_cnn` - the same generator driven by ``np.random.default_rng(seed)``, no
  hypothesis needed (for ``scripts/fuzz.py``); :func:`random_cnn_case` adds the inputs.

A graph is a sequence of *blocks* applied to tensors already built (the newest one most
often, so chains form; an older one sometimes, so tensors get several consumers):

======================  ==================================================================
``conv``                Conv (kernel 1/3/5 or 1xk/kx1, stride 1/2, dilation 1/2, symmetric,
                        asymmetric or auto pads, groups 1/depthwise/divisor, bias or not)
                        -> [BatchNormalization] -> [per-channel Mul/Add/Sub/Div constant]
                        -> [activation]
``activation``          Relu, Clip (both bounds, min only, max only; attribute form at
                        opset <= 10), LeakyRelu, SiLU (Sigmoid·Mul), bare Sigmoid
``preact``              BatchNormalization -> activation -> Conv (DenseNet's pre-activation)
``parallel``            2-4 Convs reading one tensor, mostly with identical parameters and
                        activation (horizontal merges), joined by Concat/Add/Sum or not at all
``residual``            a shape-keeping conv chain and Add/Sum/Mul with its input (either
                        operand order), [activation]
``broadcast``           Add/Mul with a broadcasting operand: constant [C,1,1], [1,C,1,1],
                        [1,1,H,W] or scalar; squeeze-excite Mul(x, Sigmoid(Conv(GAP(x))));
                        a 1x1 conv on GAP(x) added to x (the conv side broadcasts)
``concat``              Concat on the channel axis (with an existing tensor or a fresh conv),
                        on the batch/height/width axis, or of one tensor twice
``pool``                MaxPool/AveragePool (pads, ceil_mode, count_include_pad) or
                        GlobalAveragePool
``head``                GlobalAveragePool -> Flatten -> Gemm (a rank-2 graph output)
======================  ==================================================================

Every tensor no layer reads becomes a graph output, and some tensors that *are* read
become outputs too (outputs in the middle of a chain). Sizes stay tiny (spatial <= 16,
channels <= 16, batch <= 4) so that compiling a case takes moments. Weights are seeded
and BatchNorm statistics calibrated (see :mod:`._builder`), so values stay O(1).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import onnx

from ..runtime.vta.host import pool_out
from ._builder import NetBuilder, check_options, random_inputs

__all__ = ["BLOCKS", "CNNCase", "GraphOptions", "cnn_graphs", "generate", "random_cnn", "random_cnn_case"]

BLOCKS = ("conv", "activation", "parallel", "residual", "concat", "preact", "broadcast", "pool", "head")
"""Block kinds, simplest first (hypothesis shrinks a choice towards the first)."""

ACTIVATIONS = ("Relu", "Clip", "LeakyRelu", "SiLU", "Sigmoid")
_POINTWISE = {"kernel": (1, 1), "stride": 1, "dilation": 1, "pad": 0, "groups": 1, "bias": True}  # + "cout"
OPSETS = (13, 11, 17, 10)  # 10: Clip with min/max attributes


@dataclasses.dataclass(frozen=True)
class GraphOptions:
    """Bounds of the generated graphs (keyword options of :func:`random_cnn` / :func:`cnn_graphs`)."""

    max_layers: int = 12  # non-constant nodes: the target is drawn in 1..max_layers; the last block may overshoot
    max_channels: int = 16
    max_spatial: int = 16
    max_batch: int = 4
    batch: Optional[int] = None  # None: drawn from 1..3
    opset: Optional[int] = None  # None: drawn from OPSETS
    blocks: Sequence[str] = BLOCKS  # the block kinds to draw from

    def __post_init__(self) -> None:
        if self.max_layers < 1:
            raise ValueError(f"max_layers={self.max_layers}; expected >= 1")
        if not 2 <= self.max_channels <= 64 or not 2 <= self.max_spatial <= 64:
            raise ValueError("max_channels and max_spatial must lie in [2, 64]")
        unknown = [b for b in self.blocks if b not in BLOCKS]
        if unknown or not self.blocks:
            raise ValueError(f"blocks={tuple(self.blocks)}; expected a non-empty subset of {BLOCKS}")
        if self.batch is not None and not 1 <= self.batch <= self.max_batch:
            raise ValueError(f"batch={self.batch}; expected 1..max_batch={self.max_batch}")


class CNNCase(NamedTuple):
    """A generated graph and seeded inputs for it."""

    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]


# ---------------------------------------------------------------------- choice sources
class _RngChoices:
    """Choices from a numpy generator (``random_cnn``)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def int(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))

    def flag(self, p: float = 0.5) -> bool:
        return bool(self.rng.random() < p)

    def pick(self, seq: Sequence[Any]) -> Any:
        return seq[self.int(0, len(seq) - 1)]


class _HypothesisChoices:
    """Choices drawn from hypothesis ``data`` (shrinks to small ints, first items, False)."""

    def __init__(self, draw) -> None:
        from hypothesis import strategies as st

        self._draw = draw
        self._st = st

    def int(self, lo: int, hi: int) -> int:
        return self._draw(self._st.integers(lo, hi))

    def flag(self, p: float = 0.5) -> bool:
        if p <= 0:
            return False
        if p >= 1:
            return True
        return self._draw(self._st.integers(0, 99)) >= round(100 * (1 - p))

    def pick(self, seq: Sequence[Any]) -> Any:
        return seq[self.int(0, len(seq) - 1)]


# ---------------------------------------------------------------------- the generator
class _Generator:
    def __init__(self, c, options: GraphOptions, seed: int) -> None:
        self.c = c
        self.o = options
        opset = options.opset if options.opset is not None else c.pick(OPSETS)
        clip = "attributes" if opset <= 10 else "inputs"
        check_options(opset=opset, bn="separate", clip=clip)
        self.b = NetBuilder(
            "random_cnn",
            seed=seed,
            opset=opset,
            bn=c.pick(("separate", "folded")),
            clip=clip,
            quirks=c.flag(0.5),
            identity_every=c.pick((5, 2, 3)),
        )
        self.tensors: list[str] = []  # rank-4 data tensors, oldest first
        self.extra_outputs: list[str] = []
        self.rank2_outputs: list[str] = []
        self.block_id = 0

    # -- helpers ---------------------------------------------------------------
    def layers(self) -> int:
        return sum(1 for n in self.b.nodes if n.op_type not in ("Constant", "Identity"))

    def shape(self, t: str) -> tuple[int, int, int, int]:
        return self.b.shapes[t]  # type: ignore[return-value]

    def source(self) -> str:
        """The newest tensor usually; any earlier one sometimes (several consumers)."""
        if len(self.tensors) > 1 and self.c.flag(0.3):
            return self.c.pick(self.tensors[::-1])
        return self.tensors[-1]

    def add(self, t: str) -> str:
        self.tensors.append(t)
        return t

    def channels(self, hi: Optional[int] = None) -> int:
        return self.c.int(1, min(hi or self.o.max_channels, self.o.max_channels))

    # -- pieces ----------------------------------------------------------------
    def conv_params(self, x: str, cout: Optional[int] = None, *, keep_shape: bool = False) -> dict[str, Any]:
        cin = self.shape(x)[1]
        c = self.c
        kind = c.pick(("square", "square", "row", "col"))
        k = c.pick((1, 3, 5))
        kh, kw = (k, k) if kind == "square" else ((1, k) if kind == "row" else (k, 1))
        stride = 1 if keep_shape else c.pick((1, 2))
        dil = 1 if keep_shape or not c.flag(0.25) else 2
        eh, ew = (kh - 1) * dil + 1, (kw - 1) * dil + 1
        mode = "same" if keep_shape else c.pick(("same", "zero", "asym", "auto"))
        params: dict[str, Any] = {"kernel": (kh, kw), "stride": stride, "dilation": dil}
        if mode == "same":
            params["pad"] = ((eh - 1) // 2, (ew - 1) // 2)  # odd kernels: exact "same"
        elif mode == "zero":
            params["pad"] = 0
        elif mode == "asym":
            params["pad"] = (c.int(0, eh // 2), c.int(0, ew // 2), c.int(0, eh // 2), c.int(0, ew // 2))
        else:
            # onnxruntime refuses SAME_* auto_pad with dilation > 1
            params["auto_pad"] = c.pick(("SAME_UPPER", "SAME_LOWER", "VALID") if dil == 1 else ("VALID",))
        if cout is None:
            cout = cin if keep_shape else self.channels()
        group_kind = c.pick(("one", "one", "depthwise", "divisor"))
        groups = 1
        if group_kind == "depthwise" and cout % cin == 0:
            groups = cin
        elif group_kind == "divisor":
            common = [g for g in range(2, min(cin, cout) + 1) if cin % g == 0 and cout % g == 0]
            if common:
                groups = c.pick(common)
        params.update(cout=cout, groups=groups, bias=c.flag(0.5))
        geometry = {k: v for k, v in params.items() if k not in ("cout", "kernel", "bias")}
        try:
            self.b.conv_geometry(x, cout, params["kernel"], **geometry)
        except ValueError:  # too small for this kernel: a 1x1 conv always fits
            params.update(kernel=(1, 1), stride=1, dilation=1, pad=0)
            params.pop("auto_pad", None)
        return params

    def conv(self, x: str, params: dict[str, Any]) -> str:
        p = dict(params)
        cout = p.pop("cout")
        return self.b.conv(x, cout, **p)

    def act_spec(self, kinds: Sequence[str] = ACTIVATIONS) -> tuple:
        """An activation with its parameters, e.g. ``("Clip", 0.0, 6.0)``, to apply once or to several branches."""
        kind = self.c.pick(tuple(kinds))
        if kind == "LeakyRelu":
            return (kind, self.c.pick((0.01, 0.1, 0.2)))
        if kind == "Clip":
            return (kind,) + self.c.pick(((0.0, 6.0), (-1.0, 1.0), (0.0, None), (None, 1.0)))
        return (kind,)

    def activation(self, x: str, kinds: Sequence[str] = ACTIVATIONS, *, spec: Optional[tuple] = None) -> str:
        kind, *params = spec or self.act_spec(kinds)
        b = self.b
        if kind == "Relu":
            return b.relu(x)
        if kind == "LeakyRelu":
            return b.leaky_relu(x, *params)
        if kind == "SiLU":
            return b.silu(x)
        if kind == "Sigmoid":
            return b.sigmoid(x)
        return b.clip(x, *params)

    def epilogue(self, y: str) -> str:
        """[BatchNormalization] -> [per-channel affine constant] -> [activation] after a conv."""
        c, b = self.c, self.b
        if c.flag(0.4):
            y = b.batchnorm(y, eps=c.pick((1e-5, 1e-3)))
        if c.flag(0.25):
            ch = self.shape(y)[1]
            op = c.pick(("Mul", "Add", "Sub", "Div"))
            form = c.pick(((ch, 1, 1), (1, ch, 1, 1), (1,), ()))
            value = self.b.rng.uniform(0.5, 1.5, form).astype(np.float32)
            k = b.constant(value, node=c.flag(0.5))
            ins = [y, k]
            if c.flag(0.2):  # k - y (or k + y, k * y) with the conv output on the right
                ins = [k, y]
                op = "Sub" if op == "Div" else op  # k / y could divide by ~0
            y = b.binary(op, *ins)
        if c.flag(0.6):
            y = self.activation(y)
        return y

    # -- blocks ----------------------------------------------------------------
    def block_conv(self) -> None:
        x = self.source()
        self.add(self.epilogue(self.conv(x, self.conv_params(x))))

    def block_activation(self) -> None:
        self.add(self.activation(self.source()))

    def block_preact(self) -> None:
        x = self.source()
        y = self.b.batchnorm(x)
        y = self.activation(y, ("Relu", "Clip", "LeakyRelu", "SiLU"))
        self.add(self.epilogue(self.conv(y, self.conv_params(y))))

    def block_parallel(self) -> None:
        c = self.c
        x = self.source()
        n = c.int(2, 4)
        params = self.conv_params(x)
        if c.flag(0.7):  # grouped convs never merge horizontally: mostly plain ones here
            params.update(groups=1)
        act = self.act_spec(ACTIVATIONS[:4]) if c.flag(0.8) else None
        branches = []
        first = -1  # index of branch 0's Conv node, set once it is built
        for i in range(n):
            p = params
            if i > 0 and c.flag(0.2):  # one branch differs: a refusal to report
                p = self.conv_params(x)
            elif i > 0 and c.flag(0.3):  # same geometry, other width: still mergeable
                p = dict(params, cout=self.channels() if params["groups"] == 1 else params["cout"])
            if i > 0 and p is params and c.flag(0.15):  # the same weight tensor as branch 0
                p = dict(p, weight=self.b.nodes[first].input[1])
            y = self.conv(x, p)
            if i == 0:
                first = len(self.b.nodes) - 1  # the branch-0 Conv node
            if c.flag(0.2):
                y = self.b.batchnorm(y)
            branch_act = act if not c.flag(0.15) else self.act_spec()
            branches.append(self.activation(y, spec=branch_act) if branch_act else y)
        shapes = [self.shape(y) for y in branches]
        join = c.pick(("concat", "sum", "concat", "none"))
        same_spatial = all(s[0] == shapes[0][0] and s[2:] == shapes[0][2:] for s in shapes)
        if join == "concat" and same_spatial and sum(s[1] for s in shapes) <= self.o.max_channels:
            self.add(self.b.concat(branches, axis=1))
        elif join == "sum" and all(s == shapes[0] for s in shapes):
            if len(branches) == 2 and c.flag(0.5):
                self.add(self.b.add(*branches))
            else:
                self.add(self.b.sum(*branches))
        else:
            for y in branches:
                self.add(y)

    def block_residual(self) -> None:
        c, b = self.c, self.b
        x = self.source()
        y = x
        for _ in range(c.int(1, 2)):
            y = self.conv(y, self.conv_params(y, keep_shape=True))
            if c.flag(0.5):
                y = b.batchnorm(y)
            if c.flag(0.5):
                y = self.activation(y, ("Relu", "Clip", "LeakyRelu"))
        op = c.pick(("Add", "Sum", "Mul", "Sum3"))
        a, other = (y, x) if c.flag(0.5) else (x, y)
        if op == "Add":
            z = b.add(a, other)
        elif op == "Mul":
            z = b.mul(a, other)
        elif op == "Sum":
            z = b.sum(a, other)
        else:
            z = b.sum(a, other, x if c.flag(0.5) else y)
        if c.flag(0.5):
            z = self.activation(z, ("Relu", "Clip", "LeakyRelu"))
        self.add(z)

    def block_broadcast(self) -> None:
        c, b = self.c, self.b
        x = self.source()
        n, ch, h, w = self.shape(x)
        kind = c.pick(("const", "se", "conv_gap", "self"))
        if kind == "const":
            form = c.pick(((ch, 1, 1), (1, ch, 1, 1), (1, 1, h, w), (1,), ()))
            value = b.rng.uniform(0.5, 1.5, form).astype(np.float32)
            k = b.constant(value, node=c.flag(0.5))
            ins = [x, k] if c.flag(0.5) else [k, x]
            op = c.pick(("Mul", "Add"))
            self.add(b.binary(op, *ins))
        elif kind == "se":  # squeeze-excite: Mul(x, Sigmoid(fc2(act(fc1(GAP(x))))))
            s = self.conv(b.global_avgpool(x), _POINTWISE | {"cout": self.channels()})
            s = self.activation(s, ("Relu", "SiLU"))
            s = b.sigmoid(self.conv(s, _POINTWISE | {"cout": ch}))
            self.add(b.mul(s, x) if c.flag(0.5) else b.mul(x, s))
        elif kind == "conv_gap":  # the conv output [N,C,1,1] is the broadcasting operand
            s = self.conv(b.global_avgpool(x), _POINTWISE | {"cout": ch})
            self.add(b.binary(c.pick(("Add", "Mul")), s, x))
        else:  # one tensor on both sides: x + x, x * x
            y = self.conv(x, self.conv_params(x))
            self.add(b.binary(c.pick(("Add", "Mul")), y, y))

    def block_concat(self) -> None:
        c, b, o = self.c, self.b, self.o
        x = self.source()
        n, ch, h, w = self.shape(x)
        axis = c.pick((1, 1, 2, 3, 0, "twice"))
        if axis == "twice":
            if 2 * ch <= o.max_channels:
                self.add(b.concat([x, x], axis=1))
            return
        if axis == 1:
            partners = [t for t in self.tensors if t != x and self.shape(t)[::2] == (n, h) and self.shape(t)[3] == w]
            partners = [t for t in partners if ch + self.shape(t)[1] <= o.max_channels]
            if partners and c.flag(0.5):
                other = c.pick(partners[::-1])
            else:
                if ch >= o.max_channels:
                    return
                p = self.conv_params(x, cout=c.int(1, o.max_channels - ch), keep_shape=True)
                other = self.epilogue(self.conv(x, p))
            ins = [x, other] if c.flag(0.5) else [other, x]
            self.add(b.concat(ins, axis=c.pick((1, -3))))
            return
        limit = {0: o.max_batch, 2: o.max_spatial, 3: o.max_spatial}[axis]
        if 2 * self.shape(x)[axis] > limit:
            return
        p = self.conv_params(x, cout=ch, keep_shape=True)
        other = self.epilogue(self.conv(x, p))
        self.add(b.concat([x, other], axis=axis if c.flag(0.7) else axis - 4))

    def block_pool(self) -> None:
        c, b = self.c, self.b
        x = self.source()
        n, ch, h, w = self.shape(x)
        kind = c.pick(("MaxPool", "AveragePool", "GlobalAveragePool"))
        if kind == "GlobalAveragePool" or min(h, w) < 2:
            if h * w > 1:
                self.add(b.global_avgpool(x))
            return
        k = c.pick((2, 3)) if min(h, w) >= 3 else 2
        s = c.pick((1, 2))
        p = c.int(0, k // 2)
        ceil = s > 1 and c.flag(0.3)  # with stride 1 ceil_mode changes nothing (onnx.reference miscounts it)
        if ceil and any(-(-(L + 2 * p - k) // s) + 1 != pool_out(L, k, s, p, p, True) for L in (h, w)):
            ceil = False  # torch drops a last window that starts in the padding; ONNX inference does not
        if kind == "MaxPool":
            self.add(b.maxpool(x, k, s, p, ceil=ceil))
        else:
            self.add(b.avgpool(x, k, s, p, ceil=ceil, count_include_pad=c.flag(0.5)))

    def block_head(self) -> None:
        x = self.source()
        y = self.b.global_avgpool(x)
        y = self.b.flatten(y)
        self.rank2_outputs.append(self.b.linear(y, self.c.int(1, 8)))

    # -- the whole graph -------------------------------------------------------
    def run(self) -> onnx.ModelProto:
        c, o = self.c, self.o
        batch = o.batch if o.batch is not None else c.int(1, 3)
        size = c.int(1, o.max_spatial)
        width = size if c.flag(0.7) else c.int(1, o.max_spatial)
        x = self.b.input("input", (batch, self.channels(8), size, width))
        self.add(x)
        inputs = [x]
        if c.flag(0.15):  # a second graph input, same spatial size
            inputs.append(self.add(self.b.input("input_2", (batch, self.channels(8), size, width))))
        # The size is drawn first, so that hypothesis can shrink a failing graph to few layers.
        target = c.int(1, o.max_layers)
        n_blocks = 0
        while self.layers() < target and n_blocks < 2 * o.max_layers:
            kind = c.pick(tuple(o.blocks))
            with self.b.scope(f"block{self.block_id}"):
                getattr(self, f"block_{kind}")()
            self.block_id += 1
            n_blocks += 1
        if self.layers() == 0:  # every block declined (tiny tensors): one conv
            with self.b.scope("block0"):
                self.block_conv()
        read = {i for node in self.b.nodes for i in node.input}
        leaves = [t for t in self.tensors if t not in read and t not in inputs]
        middle = [t for t in self.tensors if t in read and t not in inputs]
        outputs = list(leaves) + list(self.rank2_outputs)
        for t in middle:
            if c.flag(0.15):
                outputs.append(t)  # an output in the middle of a chain
        if not outputs:
            outputs = [self.tensors[-1]]
        order = {t: i for i, t in enumerate(n for node in self.b.nodes for n in node.output)}
        outputs = sorted(dict.fromkeys(outputs), key=order.__getitem__)
        return self.b.build(outputs, doc="tvm_layerfuse.testing.graphgen", node_names=c.flag(0.85))


def generate(choices, *, seed: int = 0, **options: Any) -> onnx.ModelProto:
    """Build one graph from a choice source (``_RngChoices`` or ``_HypothesisChoices``)."""
    return _Generator(choices, GraphOptions(**options), seed).run()


def random_cnn(seed: int, **options: Any) -> onnx.ModelProto:
    """A random valid CNN, fully determined by ``seed`` (options: :class:`GraphOptions` fields)."""
    return generate(_RngChoices(np.random.default_rng([int(seed), 0x6EA9])), seed=int(seed), **options)


def random_cnn_case(seed: int, **options: Any) -> CNNCase:
    """:func:`random_cnn` plus seeded standard-normal inputs."""
    model = random_cnn(seed, **options)
    return CNNCase(model, random_inputs(model, seed))


def cnn_graphs(max_layers: int = 12, **options: Any):
    """Hypothesis strategy of :class:`CNNCase` (options: :class:`GraphOptions` fields)."""
    from hypothesis import strategies as st

    GraphOptions(max_layers=max_layers, **options)  # validate eagerly

    @st.composite
    def _cases(draw) -> CNNCase:
        seed = draw(st.integers(0, 2**31 - 1))
        model = generate(_HypothesisChoices(draw), seed=seed, max_layers=max_layers, **options)
        return CNNCase(model, random_inputs(model, seed))

    return _cases()
