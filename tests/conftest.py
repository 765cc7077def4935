import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the session (2 logical CPUs as in CI; stages ask for fractions)."""
    import ray
    ray.init(num_cpus=2, include_dashboard=False, namespace="memra-test", logging_level="WARNING",
             log_to_driver=True)
    yield
    ray.shutdown()
