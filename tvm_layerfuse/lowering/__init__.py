"""Lowering passes: concat offsets in one storage block and split-output buffers.

They run on the fused PrimFuncs (after TVM's ``FuseOps``/``FuseTIR``, before any schedule
and before ``StaticPlanBlockMemory``):

* :class:`SplitOutputBuffers` (``split_outputs.py``) - a producer followed by a split
  kernel writes each piece into its own buffer; the split kernel disappears;
* :class:`InPlaceConcat` (``inplace_concat.py``) - every producer of a concat writes its
  output straight into the concat's block at its offset (``byte_offset_i = o_i * H * W *
  itemsize`` at batch 1, strided otherwise); the concat kernel disappears; nested concats
  share one block, and so do prefix concats (DenseNet as torchvision writes it: each
  concat of a dense block is a leading slice of the block's largest);
* :class:`InlinePrologue` (``inline_prologue.py``) - a BatchNorm+Relu prologue group computes
  the normalisation inside the conv's padding stage (no normalised copy is written);
* :func:`layerfuse_pipeline` (``pipeline.py``) - TVM's default Relax pipeline for a target
  with both passes after FuseTIR, for ``tvm.compile(..., relax_pipeline=...)``;
* :func:`concat_report` - concat kernels, bytes they copy and planned activation memory.
"""

from . import pipeline
from .inline_prologue import InlinePrologue, PrologueReport
from .inplace_concat import InPlaceConcat, InPlaceReport
from .pipeline import *  # noqa: F403 - the names in pipeline.__all__
from .split_outputs import SplitOutputBuffers, SplitReport

__all__ = [
    "InlinePrologue",
    "InPlaceConcat",
    "InPlaceReport",
    "PrologueReport",
    "SplitOutputBuffers",
    "SplitReport",
    *pipeline.__all__,
]
