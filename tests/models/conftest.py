"""Fixtures of the model tests: one quickly built (barely trained) tiny model per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.demo.tiny import TinyReport, build_tiny

QUICK_STEPS = 3  # enough to exercise the warm start; the model stays nearly untrained


@pytest.fixture(scope="session")
def quick_tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TinyReport]:
    out = tmp_path_factory.mktemp("tiny") / "arith-s0"
    return out, build_tiny(out, task="arith", seed=0, steps=QUICK_STEPS)


@pytest.fixture(scope="session")
def tiny_dir(quick_tiny: tuple[Path, TinyReport]) -> Path:
    return quick_tiny[0]
