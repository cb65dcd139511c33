"""hypothesis strategies shared by the tests: adversarial float32 gradients."""

from __future__ import annotations

import struct

import torch
from hypothesis import strategies as st

# Values that break naive kernels: signed zeros, denormals, the extremes of float32,
# values that tie, and ordinary numbers.
SPECIAL_VALUES = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    1e-45,  # smallest denormal
    -1e-45,
    1.1754942e-38,  # largest denormal
    1.17549435e-38,  # smallest normal
    3.4028235e38,  # largest finite
    -3.4028235e38,
    65504.0,  # largest finite fp16
    65520.0,  # rounds to inf in fp16 without a clamp
    1e-8,
    -123.456,
]

SIZES = [1, 2, 7, 31, 1023, 1025, 4097]


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


finite_f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def gradients(draw, min_size: int = 1, max_size: int = 5000, sizes=None):
    """A 1-D float32 tensor mixing random values, special values, and repeated values.

    The size is drawn from the odd sizes in ``SIZES`` or uniformly; the contents from one
    of several regimes so that ties, zeros and extremes all occur often.
    """
    if sizes is None:
        n = draw(
            st.one_of(
                st.sampled_from([s for s in SIZES if min_size <= s <= max_size]),
                st.integers(min_size, max_size),
            )
        )
    else:
        n = draw(st.sampled_from(sizes))
    regime = draw(st.sampled_from(["normal", "ties", "special", "constant", "mixed"]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if regime == "normal":
        scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]))
        x = torch.randn(n, generator=gen) * scale
    elif regime == "ties":
        levels = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, -2.0])
        x = levels[torch.randint(0, len(levels), (n,), generator=gen)]
    elif regime == "special":
        specials = torch.tensor([_f32(v) for v in SPECIAL_VALUES], dtype=torch.float32)
        x = specials[torch.randint(0, len(specials), (n,), generator=gen)]
    elif regime == "constant":
        value = draw(st.sampled_from([0.0, -0.0, 1.5, -3.0]))
        x = torch.full((n,), value)
    else:
        x = torch.randn(n, generator=gen)
        specials = torch.tensor([_f32(v) for v in SPECIAL_VALUES], dtype=torch.float32)
        mask = torch.rand(n, generator=gen) < 0.3
        picks = specials[torch.randint(0, len(specials), (n,), generator=gen)]
        x = torch.where(mask, picks, x)
    return x.to(torch.float32).contiguous()
