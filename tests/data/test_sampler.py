"""The prompt sampler: per-epoch shuffles, dropped tails, exact checkpoint/resume across epochs."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.data.sampler import PromptSampler, eval_batches
from engine.errors import DataError


def take(sampler: PromptSampler, steps: int) -> list[list[int]]:
    return list(itertools.islice(sampler, steps))


def resumed(sampler: PromptSampler) -> PromptSampler:
    """A new sampler from `sampler`'s state after a JSON round trip (as trainer.json stores it)."""
    other = PromptSampler(sampler.n_rows, sampler.batch_size, sampler.seed, sampler.shuffle)
    other.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
    return other


def test_each_epoch_is_a_fresh_permutation_without_the_tail() -> None:
    sampler = PromptSampler(n_rows=10, batch_size=3, seed=7)
    assert sampler.steps_per_epoch == 3
    epochs = [take(sampler, 3) for _ in range(3)]
    for steps in epochs:
        flat = [i for step in steps for i in step]
        assert all(len(step) == 3 for step in steps) and len(set(flat)) == 9 and set(flat) <= set(range(10))
    assert epochs[0] != epochs[1] != epochs[2]
    assert sampler.state_dict()["epoch"] == 3 and sampler.steps == 9
    again = PromptSampler(n_rows=10, batch_size=3, seed=7)
    assert take(again, 9) == [step for steps in epochs for step in steps]
    assert take(PromptSampler(10, 3, seed=8), 3) != epochs[0]


def test_no_shuffle_keeps_file_order() -> None:
    assert take(PromptSampler(5, 2, seed=0, shuffle=False), 3) == [[0, 1], [2, 3], [0, 1]]


def test_order_is_the_same_in_another_process() -> None:
    # The permutation must not depend on PYTHONHASHSEED or the process: every rank and every resumed
    # run derives the same one.
    code = "from engine.data.sampler import PromptSampler as S; print(S(50, 7, seed=3).epoch_order(2))"
    env = {**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(PromptSampler(50, 7, seed=3).epoch_order(2))


def test_resume_mid_epoch_equals_uninterrupted_across_epoch_boundaries() -> None:
    n_rows, batch_size, seed = 11, 3, 5  # 3 steps per epoch, 2 rows dropped each epoch
    reference = take(PromptSampler(n_rows, batch_size, seed), 12)
    for k in range(9):  # checkpoint after k steps: mid-epoch, at boundaries, in later epochs
        sampler = PromptSampler(n_rows, batch_size, seed)
        before = take(sampler, k)
        after = take(resumed(sampler), 12 - k)
        assert before + after == reference, f"resumed after {k} steps"


def test_resume_exactly_at_an_epoch_boundary_starts_the_next_epoch() -> None:
    sampler = PromptSampler(n_rows=8, batch_size=4, seed=1)
    first_epoch = take(sampler, 2)
    state = sampler.state_dict()
    assert (state["epoch"], state["position"], state["steps"]) == (1, 0, 2)
    other = resumed(sampler)
    step = other.next_indices()
    assert len(step) == 4 and step == sampler.epoch_order(1)[:4]
    assert sorted(step + other.next_indices()) == sorted(i for s in first_epoch for i in s)
    # A state written as "end of epoch 0" (position == steps per epoch) also goes on with epoch 1.
    other = PromptSampler(8, 4, seed=1)
    other.load_state_dict({**state, "epoch": 0, "position": 2})
    assert other.next_indices() == step


def test_a_single_step_epoch_never_yields_an_empty_step() -> None:
    sampler = PromptSampler(n_rows=5, batch_size=4, seed=0)
    for _ in range(4):
        sampler = resumed(sampler)
        assert len(sampler.next_indices()) == 4


@settings(max_examples=60, deadline=None)
@given(
    n_rows=st.integers(1, 40),
    batch_size=st.integers(1, 40),
    seed=st.integers(0, 2**31),
    k=st.integers(0, 30),
    shuffle=st.booleans(),
)
def test_resume_after_any_step_is_exact(
    n_rows: int, batch_size: int, seed: int, k: int, shuffle: bool
) -> None:
    if batch_size > n_rows:
        return
    reference = take(PromptSampler(n_rows, batch_size, seed, shuffle), k + 10)
    sampler = PromptSampler(n_rows, batch_size, seed, shuffle)
    assert take(sampler, k) + take(resumed(sampler), 10) == reference


def test_batch_larger_than_the_dataset_is_refused() -> None:
    with pytest.raises(
        DataError, match=r"batch_size=9 is larger than the dataset \(8 rows after filtering\)"
    ):
        PromptSampler(n_rows=8, batch_size=9, seed=0)
    with pytest.raises(DataError, match="at least one row"):
        PromptSampler(n_rows=0, batch_size=1, seed=0)


def test_a_state_for_other_data_or_an_inconsistent_state_is_refused() -> None:
    state = PromptSampler(10, 2, seed=0).state_dict()
    with pytest.raises(DataError, match=r"sampler state has n_rows=10 but this sampler has n_rows=12"):
        PromptSampler(12, 2, seed=0).load_state_dict(state)
    with pytest.raises(DataError, match=r"seed=0 but this sampler has seed=1"):
        PromptSampler(10, 2, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match=r"lacks position"):
        PromptSampler(10, 2, seed=0).load_state_dict({k: v for k, v in state.items() if k != "position"})
    with pytest.raises(DataError, match=r"inconsistent: epoch=1, position=2, steps=3 with 5 steps per epoch"):
        PromptSampler(10, 2, seed=0).load_state_dict({**state, "epoch": 1, "position": 2, "steps": 3})


def test_eval_batches_cover_every_row_once_in_order() -> None:
    assert eval_batches(5, 2) == [[0, 1], [2, 3], [4]]
    assert eval_batches(2, 64) == [[0, 1]]
