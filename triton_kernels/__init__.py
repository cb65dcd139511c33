"""Compression kernels of sparsecomm, installed as ``sparsecomm.triton_kernels``.

One module per operation; each holds the ``@triton.jit`` kernel, its launcher and the
pure-torch reference (``*_ref``) that defines what the kernel computes. The references
are also the CPU path. ``sparsecomm._ops`` picks one of the two for each call.

=================  ==========================================================
module             operation
=================  ==========================================================
``threshold``      error-feedback magnitude threshold, compacted (index, value)
``topk``           error-feedback exact top-k, ties to the lower index
``cast``           error-feedback cast to fp16 / bf16
``scatter_add``    deterministic sum of W ranks' (index, value) messages
=================  ==========================================================
"""
