"""DAPO's overlong reward shaping, by hand."""

from __future__ import annotations

import re

import pytest
import torch

from engine.errors import ConfigError
from engine.rewards.shaping import overlong_penalty
from flows.config import load_config


def test_overlong_penalty_by_hand() -> None:
    # limit 16 tokens, buffer 4: no penalty up to 12, then -0.25 factor per token over 12, -factor at 16
    lengths = torch.tensor([0, 12, 13, 14, 16])
    assert overlong_penalty(lengths, 16, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 16, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]


@pytest.mark.parametrize(("overrides", "message"), [
    (["reward.overlong_buffer_len=16", "rollout.max_new_tokens=16"],
     "reward.overlong_buffer_len=16 is not allowed: must be below rollout.max_new_tokens (16)"),
    (["reward.overlong_penalty_factor=2"],
     "reward.overlong_penalty_factor=2.0 is not allowed: scales the overlong penalty: it needs "
     "reward.overlong_buffer_len > 0"),
])
def test_overlong_settings_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_a_multi_turn_response_is_as_long_as_the_tokens_the_limit_counts() -> None:
    """A multi-turn response's length counts its tools' observations, which take room under
    rollout.max_new_tokens though they are not trained on: DAPO's penalty, response_length/* and its
    clip ratio all read that one length (they counted the response mask's trained tokens only, so a
    response at the limit was neither penalised nor clipped)."""
    from types import SimpleNamespace

    from engine.advantage import data_metrics
    from engine.batch import Batch, response_lengths
    from engine.config import RewardConfig
    from tasks.stages import rule_scores

    # limit 8: row 0 fills it (3 generated, 3 observation, 2 generated); row 1 has 4 generated tokens
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0]])
    trained = torch.tensor([[1, 1, 1, 0, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0]])
    batch = Batch({"input_ids": torch.ones(2, 10, dtype=torch.long),
                   "attention_mask": torch.cat([torch.ones(2, 2, dtype=torch.long), attention], 1),
                   "responses": torch.ones(2, 8, dtype=torch.long), "response_mask": trained,
                   "token_scores": torch.zeros(2, 8)},
                  {"data_source": ["rlflow/sort"] * 2, "response_text": ["1 2", "1 2"], "ground_truth": ["1 2"] * 2,
                   "extra_info": [{}, {}]})  # fmt: skip
    assert response_lengths(batch).tolist() == [8, 4]
    metrics = data_metrics(batch, max_new_tokens=8)
    assert metrics["response_length/mean"] == 6.0 and metrics["response_length/max"] == 8.0
    assert metrics["response_length/clip_ratio"] == 0.5  # row 0 is at the limit
    ctx = SimpleNamespace(plan=SimpleNamespace(reward=RewardConfig(overlong_buffer_len=4, overlong_penalty_factor=1.0),
                                               rollout=SimpleNamespace(max_new_tokens=8)))
    _, penalty, _ = rule_scores(ctx, batch)  # type: ignore[arg-type]
    assert penalty.tolist() == [-1.0, 0.0]  # at the limit: the whole factor; 4 tokens: none
