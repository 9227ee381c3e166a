"""A local Ray instance for tests: 2 CPUs, no dashboard, a short temp dir (Unix socket paths are short).

Import `ray_cluster` into a test module to use it. It is session-scoped; if another module's copy
started Ray already it is reused, and only the copy that started Ray shuts it down.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp", ignore_cleanup_errors=True) as temp_dir:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            _temp_dir=temp_dir,
            configure_logging=False,
            log_to_driver=True,
        )
        try:
            yield
        finally:
            ray.shutdown()
