"""What a step sent, for ``opt.last_stats`` and ``opt.total_stats``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class StepStats:
    """Bytes and elements one rank sent, in one step (``last_stats``) or in all steps so far
    (``total_stats``).

    Attributes:
        bytes_sent: this rank's payload put into the collectives (padding included, the
            small count and flag exchanges not).
        dense_bytes: what a float32 all-reduce of the same gradients would put in.
        elements_sent: gradient elements this rank sent (values, not bytes).
        elements: gradient elements in the buckets.
        steps: steps counted (1 in ``last_stats``).
        skipped_steps: steps that changed no parameter: skipped for a non-finite gradient
            (under GradScaler, or refused with ``NonFiniteGradientError``), dropped
            (``drop_step()``), or left without ``step()`` by ``zero_grad()``.
        compress_seconds: time spent compressing (``profile=True`` only, else 0).
        communicate_seconds: time spent inside collectives (``profile=True`` only).
        aggregate_seconds: time spent decoding and averaging what arrived (``profile=True``
            only).
        scheduled_density: the density the compressor's schedule set for the step
            (``TopK.density_at``; 1.0 for Dense and Cast, 0.0 for Threshold, whose density
            follows the data). In ``total_stats``: the latest step's, not a sum.
    """

    bytes_sent: int = 0
    dense_bytes: int = 0
    elements_sent: int = 0
    elements: int = 0
    steps: int = 0
    skipped_steps: int = 0
    compress_seconds: float = 0.0
    communicate_seconds: float = 0.0
    aggregate_seconds: float = 0.0
    scheduled_density: float = 0.0

    @property
    def density(self) -> float:
        """Fraction of gradient elements sent."""
        return self.elements_sent / self.elements if self.elements else 0.0

    @property
    def compression_ratio(self) -> float:
        """``dense_bytes / bytes_sent``: how many times fewer bytes than fp32 all-reduce."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("inf")

    def as_dict(self) -> dict[str, float]:
        """Flat ``{name: number}``, for ``SummaryWriter.add_scalars`` or a JSON log."""
        out = asdict(self)
        out["density"] = self.density
        return out

    def __add__(self, other: StepStats) -> StepStats:
        # (not asdict(), which deep-copies every field: this runs every step)
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in _FIELDS}
        summed["scheduled_density"] = (
            other.scheduled_density if other.steps else self.scheduled_density
        )
        return StepStats(**summed)


_FIELDS = fields(StepStats)
