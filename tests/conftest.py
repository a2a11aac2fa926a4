import os
import sys
import warnings

import pytest

# torch's OpenMP threads spin-wait by default; on a loaded 2-core machine (CI, shared dev
# boxes) spinning threads starve each other and a 40-token step can take seconds.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  (after the OpenMP setting)
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))  # tests import their helpers (hf_models, reference, ...)

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")

# CI runs a seeded, bounded subset; `-m slow` runs the long sweeps, and DTREE_HYPOTHESIS=sweep
# raises every property test's example count.
settings.register_profile(
    "ci", max_examples=20, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True
)
settings.register_profile(
    "sweep", max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True
)
settings.load_profile(os.environ.get("DTREE_HYPOTHESIS", "ci"))

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
