"""Building blocks of the fast CPU paths (``*_cpu``): chunked passes and candidate lists.

The references (``*_ref``) spell each operation as whole-tensor torch ops: every step
allocates an ``n``-element temporary (fresh pages, which the kernel zero-fills on first
touch) and streams it through memory. The CPU paths instead walk the tensor in chunks of
``CHUNK`` elements (1 MiB of float32) whose temporaries stay in cache and are allocated
once per call. Floating-point arithmetic is always done by the same torch op as in the
reference, so the bits are the same; integer and boolean work (order keys, comparisons,
index lists, selection) is done with numpy on views of the same memory, whose comparison
and ``flatnonzero`` loops are several times faster than torch's on the CPU.
"""

from __future__ import annotations

import numpy as np
import torch

# Elements per chunk: 1 MiB of float32. Each op costs a few microseconds of Python and
# dispatch whatever its size, so a chunk must be large enough to hide that, and its three or
# four live arrays must still sit in cache. Sweep on a 2-core AMD EPYC (1 MiB L2 per core,
# 32 MiB L3; a shared machine, so only coarse, 2026-12-03): 2**17 to 2**19 within noise of
# each other for top-k, threshold and cast at 1e6 and 1.4e7 elements, 2**16 and 2**20 up to
# 1.3x slower.
CHUNK = 1 << 18

# Order key of abs(x) from the bits of x: clear the sign. As int32 it orders magnitudes as
# floats do, with -0.0 == 0.0 and every NaN above inf (a NaN's key exceeds inf's 0x7F800000).
SIGN_CLEAR = 0x7FFFFFFF


def require_cpu(tensor: torch.Tensor, op: str) -> None:
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{op} runs on CPU tensors, got one on {tensor.device}; sparsecomm's dispatch "
            "(sparsecomm._ops) sends CUDA tensors to the Triton kernels"
        )


def check_accumulated(accumulated: bool, residual: torch.Tensor | None, op: str) -> None:
    if accumulated and residual is not None:
        raise ValueError(
            f"{op}(accumulated=True) takes acc = grad + residual, already added, in grad, "
            "and leaves the new residual there: pass residual=None"
        )


def int_view(tensor: torch.Tensor) -> np.ndarray:
    """The float32 tensor's memory as a numpy int32 array (no copy)."""
    return tensor.detach().numpy().view(np.int32)


def float32_key(value: float) -> int:
    """Order key of a non-negative float, rounded to float32 as torch does when it compares."""
    bits = torch.tensor(value, dtype=torch.float32).view(torch.int32).item()
    return bits & SIGN_CLEAR


def chunks(n: int):
    for start in range(0, n, CHUNK):
        yield start, min(start + CHUNK, n)


class Candidates:
    """Collects, chunk by chunk, the positions (int32, ascending) and the value bits (int32)
    of the elements whose order key is at least ``lo``, copied while the chunk is in cache."""

    def __init__(self, n: int, lo: int):
        self.lo = lo
        size = min(n, CHUNK)
        self._keys = np.empty(size, dtype=np.int32)
        self._mask = np.empty(size, dtype=np.bool_)
        self.position_parts: list[np.ndarray] = []
        self.value_parts: list[np.ndarray] = []
        self.count = 0

    def add_chunk(self, bits: np.ndarray, start: int, zero: bool = False) -> None:
        """Take the chunk ``bits`` (int32 view of float32 values) that starts at element
        ``start``; with ``zero``, write +0.0 over its candidates once they are copied."""
        size = bits.shape[0]
        keys = self._keys[:size]
        mask = self._mask[:size]
        np.bitwise_and(bits, SIGN_CLEAR, out=keys)
        np.greater_equal(keys, self.lo, out=mask)
        local = np.flatnonzero(mask)
        if local.size:
            self.value_parts.append(bits[local])
            if zero:
                bits[local] = 0
            local += start
            self.position_parts.append(local.astype(np.int32))
            self.count += local.size

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(positions, value bits) of all candidates, int32, in ascending position order."""
        if not self.position_parts:
            empty = np.empty(0, dtype=np.int32)
            return empty, empty
        if len(self.position_parts) == 1:
            return self.position_parts[0], self.value_parts[0]
        return np.concatenate(self.position_parts), np.concatenate(self.value_parts)


def select_top(keys: np.ndarray, k: int) -> np.ndarray | None:
    """Which of the keys (listed in ascending position order, at least ``k`` of them) are
    the ``k`` largest, ties to the earlier one: a boolean mask, or ``None`` for all."""
    c = keys.shape[0]
    if k == c:
        return None
    if k == 0:
        return np.zeros(c, dtype=np.bool_)
    # The k-th largest key: position c - k of the keys in ascending order (introselect on
    # int32, O(c), no index array).
    kth = int(np.partition(keys, c - k)[c - k])
    take = keys > kth
    need = k - int(np.count_nonzero(take))
    ties = keys == kth
    if int(np.count_nonzero(ties)) > need:
        # Only the first `need` ties in position order: cut after the need-th one.
        cut = int(np.searchsorted(np.cumsum(ties, dtype=np.int32), need)) + 1
        ties[cut:] = False
    take |= ties
    return take
