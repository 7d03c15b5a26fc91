from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A quickly built tiny model (few warm-start steps): real files, loaded like any HF model."""
    from engine.tiny import build_tiny

    out = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny(out, task="arith", seed=0, steps=30)
    return out
