"""``TopK(select="adam")`` on CUDA: score a bucket in Adam's units and send its k best.

For a bucket of parameters laid out one after the other, with each member's second moment
``v`` (``exp_avg_sq``, a tensor of its own) and ``eps``:

    acc   = grad + residual                      (written back into grad)
    score = |acc| / (sqrt(max(v, mean(v))) + eps)  (mean over the member)

then the k largest scores are chosen with :func:`~triton_kernels.topk.topk_compress` (ties to
the lower index, NaN first), their ``acc`` values are taken and zeroed in ``grad``, which is
left holding the new residual. :func:`adam_topk_ref` is the definition in torch ops;
:func:`adam_topk` computes the same bits with two Triton kernels and the top-k kernels, no
host synchronisation, and can read ``grad`` and ``residual`` through an ``addresses`` table
(``_indirect``) so that a CUDA graph of it serves buffers that move (the members' ``v``
must stay where they were when the graph was captured).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _indirect
from .topk import topk_compress, topk_compress_ref

BLOCK = 2048
NUM_WARPS = 8
MAX_BLOCK_PROGRAMS = 4096  # programs per member; each loops over the blocks it is given


@triton.jit
def _score_kernel(
    grad_ptr,
    residual_ptr,
    addresses_ptr,
    variances_ptr,  # int64: each member's v address
    starts_ptr,
    numels_ptr,
    means_ptr,
    eps_ptr,
    score_ptr,
    HAS_RESIDUAL: tl.constexpr,
    INDIRECT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    member = tl.program_id(0)
    grad_ptr = _indirect.resolve(addresses_ptr, _indirect.GRAD, grad_ptr, INDIRECT)
    residual_ptr = _indirect.resolve(
        addresses_ptr, _indirect.RESIDUAL, residual_ptr, INDIRECT and HAS_RESIDUAL
    )
    v_ptr = tl.load(variances_ptr + member).to(tl.pointer_type(tl.float32))
    start = tl.load(starts_ptr + member)
    n = tl.load(numels_ptr + member)
    mean = tl.load(means_ptr + member)
    eps = tl.load(eps_ptr + member)
    for block in range(tl.program_id(1), tl.cdiv(n, BLOCK), tl.num_programs(1)):
        offsets = block * BLOCK + tl.arange(0, BLOCK)  # < n <= 2**31 - 1
        mask = offsets < n
        where = start + offsets
        acc = tl.load(grad_ptr + where, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            acc = acc + tl.load(residual_ptr + where, mask=mask, other=0.0)
            tl.store(grad_ptr + where, acc, mask=mask)
        v = tl.load(v_ptr + offsets, mask=mask, other=1.0)
        floor = tl.maximum(v, mean, propagate_nan=tl.PropagateNan.ALL)
        divisor = tl.sqrt_rn(floor) + eps
        tl.store(score_ptr + where, tl.div_rn(tl.abs(acc), divisor), mask=mask)


@triton.jit
def _take_kernel(
    grad_ptr, addresses_ptr, indices_ptr, values_ptr, k, INDIRECT: tl.constexpr, BLOCK: tl.constexpr
):
    grad_ptr = _indirect.resolve(addresses_ptr, _indirect.GRAD, grad_ptr, INDIRECT)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < k
    where = tl.load(indices_ptr + offsets, mask=mask, other=0).to(tl.int64)
    tl.store(values_ptr + offsets, tl.load(grad_ptr + where, mask=mask), mask=mask)


@triton.jit
def _zero_kernel(
    grad_ptr, addresses_ptr, indices_ptr, k, INDIRECT: tl.constexpr, BLOCK: tl.constexpr
):
    # A launch of its own, after _take_kernel: in one program, the thread that zeroes an
    # element need not be the one that read it, and nothing orders the two (on an H100, k =
    # 1e6, about 700 of the values taken read zeros).
    grad_ptr = _indirect.resolve(addresses_ptr, _indirect.GRAD, grad_ptr, INDIRECT)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < k
    where = tl.load(indices_ptr + offsets, mask=mask, other=0).to(tl.int64)
    tl.store(grad_ptr + where, tl.zeros([BLOCK], tl.float32), mask=mask)


class Members:
    """A bucket's members as :func:`adam_topk` reads them: where each starts and how many
    elements it has, its ``v`` (float32, contiguous, shaped like the member) and ``eps``,
    kept on the device once; :meth:`means` computes the members' mean ``v`` (device ops
    only)."""

    def __init__(self, numels: list[int], variances: list[torch.Tensor], eps: list[float]):
        device = variances[0].device
        for v, numel in zip(variances, numels):
            if v.dtype != torch.float32 or not v.is_contiguous() or v.numel() != numel:
                raise ValueError("each v must be float32, contiguous, with its member's size")
        starts = [sum(numels[:i]) for i in range(len(numels))]
        self.variances = variances
        self.numel = sum(numels)
        self.max_numel = max(numels)
        self.starts = torch.tensor(starts, dtype=torch.int64, device=device)
        self.numels = torch.tensor(numels, dtype=torch.int64, device=device)
        self.sizes = self.numels.float()
        self.addresses = torch.tensor(
            [v.data_ptr() for v in variances], dtype=torch.int64, device=device
        )
        self.eps = torch.tensor(eps, dtype=torch.float32, device=device)
        #: What a CUDA graph of :func:`adam_topk` depends on beyond the buffers it reads
        #: through ``addresses``: the ``v`` tensors' places and the ``eps`` values.
        self.signature = (tuple(v.data_ptr() for v in variances), tuple(eps), tuple(numels))

    def means(self) -> torch.Tensor:
        return means_of(self.variances, self.sizes)


def means_of(variances: list[torch.Tensor], sizes: torch.Tensor) -> torch.Tensor:
    """Each member's floor: the mean of its ``v`` (its sum, ``v >= 0``, over its size)."""
    return torch.stack(torch._foreach_norm(variances, 1)).div_(sizes)


def score_ref(
    acc: torch.Tensor,
    variances: list[torch.Tensor],
    numels: torch.Tensor,
    sizes: torch.Tensor,
    eps: torch.Tensor,
) -> torch.Tensor:
    """``|acc| / (sqrt(max(v, floor)) + eps)`` member by member, in torch ops: ``acc`` the
    bucket, ``variances`` the members' ``v`` (float32, flat), ``numels`` their sizes (int64)
    and ``sizes`` the same as float32, ``eps`` theirs (float32, > 0), on ``acc``'s device.
    Two bucket-sized buffers beside the score."""
    n = acc.numel()
    floor = torch.repeat_interleave(means_of(variances, sizes), numels, output_size=n)
    divisor = torch.cat(variances)
    torch.maximum(divisor, floor, out=divisor)
    score = torch.abs(acc, out=floor)
    divisor.sqrt_().add_(torch.repeat_interleave(eps, numels, output_size=n))
    return score.div_(divisor)


def adam_topk(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    members: Members,
    k: int,
    addresses: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`adam_topk_ref`: the same bits, no host synchronisation.

    Args:
        grad: the bucket, 1-D contiguous float32 CUDA tensor; left holding the new residual
            (``acc`` with the sent elements zeroed).
        residual: float32 like ``grad``, read only; None: ``acc = grad``.
        members: the bucket's members (:class:`Members`).
        k: elements to send, ``1 <= k <= grad.numel()``.
        addresses: as for :func:`~triton_kernels.topk.topk_compress` (slots GRAD and
            RESIDUAL), or None.

    Returns:
        ``(indices, values)``: ``k`` int32 indices in ascending order and ``acc`` there.
    """
    n = grad.numel()
    if members.numel != n:
        raise ValueError(f"the members hold {members.numel} elements, the bucket {n}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    _indirect.check_addresses(addresses, grad.device, grad, residual)
    indirect = addresses is not None
    score = torch.empty_like(grad)
    means = members.means()
    blocks = min(triton.cdiv(members.max_numel, BLOCK), MAX_BLOCK_PROGRAMS)
    _score_kernel[(len(members.variances), blocks)](
        grad, grad if residual is None else residual, addresses if indirect else grad,
        members.addresses, members.starts, members.numels, means, members.eps, score,
        HAS_RESIDUAL=residual is not None, INDIRECT=indirect, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
    indices, _ = topk_compress(score, None, k)
    values = torch.empty(k, dtype=torch.float32, device=grad.device)
    grid = (triton.cdiv(k, 1024),)
    table = addresses if indirect else grad
    _take_kernel[grid](grad, table, indices, values, k, INDIRECT=indirect, BLOCK=1024)
    _zero_kernel[grid](grad, table, indices, k, INDIRECT=indirect, BLOCK=1024)
    return indices, values


def adam_topk_ref(
    grad: torch.Tensor, residual: torch.Tensor | None, members: Members, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of :func:`adam_topk` in torch ops."""
    if residual is not None:
        grad.add_(residual)
    variances = [v.reshape(-1) for v in members.variances]
    score = score_ref(grad, variances, members.numels, members.sizes, members.eps)
    indices, _ = topk_compress_ref(score, None, k)
    values = grad[indices.long()]
    grad[indices.long()] = 0.0
    return indices, values
