"""The Relax passes that realise a fusion plan on an IRModule, and the import/compile plumbing.

* :func:`import_onnx` - ONNX -> (IRModule with weights as parameters, weight values, first graph);
* :class:`FoldAffineIntoConv2D` - vertical merge: BatchNorm and per-channel Mul/Add/Sub/Div
  folded into the conv2d weight and bias;
* :class:`MergeParallelConv2D` - horizontal merge: parallel conv2d reading one tensor become
  one conv2d over the concatenated weights and a split;
* :class:`CancelSplitConcat` - a split whose pieces are concatenated back in order is the
  tensor itself;
* :class:`FuseConv2DEpilogue` - vertical + element-wise merge: conv2d + bias + [residual
  add/mul] + [activation] grouped into one function per group, lowered to one TIR kernel;
* :func:`fuse`, :func:`build`, :func:`run`, :func:`count_kernels` - the pipeline.
"""

from .cancel_split_concat import CancelSplitConcat
from .fold_affine import FoldAffineIntoConv2D
from .fuse_epilogue import FuseConv2DEpilogue
from .horizontal import MergeParallelConv2D
from .importer import RelaxImportError, UnsupportedOpError, import_onnx
from .pipeline import (
    FuseResult,
    KernelCount,
    bind_params,
    build,
    count_kernels,
    default_target,
    fuse,
    fuse_with_report,
    kernel_count,
    lift_weights,
    lower,
    run,
    unfused,
)

__all__ = [
    "CancelSplitConcat",
    "FoldAffineIntoConv2D",
    "FuseConv2DEpilogue",
    "FuseResult",
    "KernelCount",
    "MergeParallelConv2D",
    "RelaxImportError",
    "UnsupportedOpError",
    "bind_params",
    "build",
    "count_kernels",
    "default_target",
    "fuse",
    "fuse_with_report",
    "import_onnx",
    "kernel_count",
    "lift_weights",
    "lower",
    "run",
    "unfused",
]
