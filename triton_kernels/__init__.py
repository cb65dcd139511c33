"""Compression kernels of sparsecomm (and its optimizer's), installed as
``sparsecomm.triton_kernels``.

One module per operation; each holds the ``@triton.jit`` kernel, its launcher and the
pure-torch reference (``*_ref``) that defines what the kernel computes, and a fast CPU
version (``*_cpu``) with the same signature and the same bits as the reference.
``sparsecomm._ops`` picks one of them for each call.

=================  ==========================================================
module             operation
=================  ==========================================================
``threshold``      error-feedback magnitude threshold, compacted (index, value)
``topk``           error-feedback exact top-k, ties to the lower index
``cast``           error-feedback cast to fp16 / bf16
``scatter_add``    deterministic sum of W ranks' (index, value) messages
``catchup``        ``sparsecomm.CatchUpAdamW``'s step of one parameter, one pass
``adam_score``     ``TopK(select="adam")``: a bucket scored in Adam's units, its k best
``move_if``        a copy and a zeroing decided by a flag on the device (a fused Adam
                   stepped ahead of the verdict)
=================  ==========================================================

``MAX_NUMEL`` (``2**31 - 1``, from ``_checks``) is the one definition of the int32 index
limit: the most elements a flat tensor passed to any of these operations may hold.
"""

from ._checks import MAX_NUMEL, DtypeError

__all__ = ["MAX_NUMEL", "DtypeError"]
