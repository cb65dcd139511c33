"""sparsecomm: compressed gradient exchange with error feedback for data-parallel training.

Wrap any ``torch.optim`` optimizer in :class:`CompressedOptimizer` and pick a compressor:
:class:`Dense`, :class:`Cast`, :class:`Threshold` or :class:`TopK`; or keep
``DistributedDataParallel`` and register :func:`ddp_comm_hook`'s hook on it. Behind a sparse
compressor under AdamW, wrap :class:`CatchUpAdamW` (it credits a coordinate the steps it waited
to be sent) or, with an update exchange (``exchange="local_updates"``),
:class:`SharedMomentAdamW` (its second moment is the ranks' averaged gradient's, shared). The
compression kernels live in ``sparsecomm.triton_kernels`` (Triton for CUDA tensors, torch
references on CPU).
"""

from ._stats import StepStats
from .catchup import CatchUpAdamW
from .compressors import Cast, Compressor, Dense, Threshold, TopK
from .ddp import DDPCommHookState, ddp_comm_hook
from .optimizer import CompressedOptimizer, NonFiniteGradientError, StepDroppedError
from .shared_moment import SharedMomentAdamW

__version__ = "0.1.0"

__all__ = [
    "CompressedOptimizer",
    "CatchUpAdamW",
    "SharedMomentAdamW",
    "Compressor",
    "Dense",
    "Cast",
    "Threshold",
    "TopK",
    "StepStats",
    "NonFiniteGradientError",
    "StepDroppedError",
    "ddp_comm_hook",
    "DDPCommHookState",
]
