from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.services import ray_head


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    import ray

    with ray_head(num_cpus=4) as address:
        ray.init(address=address, namespace="rlflow", log_to_driver=False)
        try:
            yield address
        finally:
            ray.shutdown()
