import os

import torch
from hypothesis import HealthCheck, settings

# Property tests draw shapes and seeds; tensors come from a seeded torch generator.
settings.register_profile(
    "default", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
