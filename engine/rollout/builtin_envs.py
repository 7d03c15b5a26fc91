"""Environments that come with rlflow (rollout.env=engine.rollout.builtin_envs:GuessNumber).

This module imports nothing of rlflow's: each episode's sandbox child imports it, and pays for every
import once per episode.
"""

from __future__ import annotations

import random
import re
from typing import Any

_NUMBER = re.compile(r"-?\d+")


class GuessNumber:
    """Guess a secret number from "higher" / "lower" replies, within rollout.multi_turn.max_turns turns.

    The range is 1 to the row's extra_info["high"] (default 16); the secret is the row's ground_truth
    where that is an integer in the range, else drawn from the episode's seed (so any prompt data serves:
    its rows are the episodes). The prompt is one user message, "guess 1-16". Each turn's first integer is
    the guess: the right one ends the episode with reward 1; another gets "higher" or "lower" (reward 0); a
    turn without an integer gets "say a number" (reward 0)."""

    def init(self, row: dict[str, Any]) -> list[dict[str, str]]:
        extra = row.get("extra_info")
        self.high = int(extra.get("high", 16)) if isinstance(extra, dict) else 16
        truth = str(row.get("ground_truth", "")).strip()
        given = int(truth) if truth.isdigit() and len(truth) < 10 else 0
        self.secret = given if 1 <= given <= self.high else random.Random(row.get("seed")).randint(1, self.high)
        self.guesses = 0
        return [{"role": "user", "content": f"guess 1-{self.high}"}]

    def step(self, assistant_text: str) -> tuple[list[dict[str, str]], float, bool, dict[str, Any]]:
        found = _NUMBER.search(assistant_text)
        if found is None:
            return [{"role": "user", "content": "say a number"}], 0.0, False, {"valid": False}
        guess = int(found.group())
        self.guesses += 1
        if guess == self.secret:
            return [], 1.0, True, {"guesses": self.guesses}
        hint = "higher" if guess < self.secret else "lower"
        return [{"role": "user", "content": hint}], 0.0, False, {"guesses": self.guesses}
