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
