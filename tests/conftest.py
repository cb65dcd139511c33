import os

import torch

# Triton kernels run in Triton's interpreter on CPU tensors when there is no GPU. The
# variable must be set before anything imports triton, so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

# HYPOTHESIS_PROFILE picks one (default "ci"):
#   ci       the same examples on every run (derandomized), so CI is reproducible;
#   explore  new random examples each run, five times as many: to look for bugs locally,
#            e.g. HYPOTHESIS_PROFILE=explore python -m pytest tests/test_distributed.py;
#            a failure prints the @reproduce_failure blob that replays it;
#   dev      random, 200 examples per test that sets no count of its own.
_SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=60, suppress_health_check=_SUPPRESSED
)
settings.register_profile(
    "explore",
    derandomize=False,
    deadline=None,
    max_examples=300,
    suppress_health_check=_SUPPRESSED,
    print_blob=True,
)
settings.register_profile("dev", deadline=None, max_examples=200)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)

# A test that sets its own example count (because each example is slow) multiplies it by
# this through examples(n): explore then draws more there too.
_EXAMPLES_FACTOR = {"explore": 5}.get(PROFILE, 1)


def examples(n: int) -> int:
    """``n`` examples under the ci profile, more under explore (for ``@settings``)."""
    return n * _EXAMPLES_FACTOR


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
