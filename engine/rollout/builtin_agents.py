"""Agents that come with rlflow (rollout.agent=engine.rollout.builtin_agents:guess_number).

Written against the `openai` client alone, as any agent is; like engine.rollout.builtin_envs this module
imports nothing of rlflow's (each episode's sandbox child imports it).
"""

from __future__ import annotations

import random
import re
from typing import Any

_NUMBER = re.compile(r"-?\d+")


def guess_number(client: Any, row: dict[str, Any]) -> float:
    """engine.rollout.builtin_envs.GuessNumber played as an agent: it asks "guess 1-16", reads the first
    integer of each answer, and replies "higher", "lower" or "say a number" until the guess is right (reward
    1) or the episode has no room left (the endpoint's 400; reward 0). Same secret, same messages: with
    the same seeds its rows are the environment's."""
    extra = row.get("extra_info")
    high = int(extra.get("high", 16)) if isinstance(extra, dict) else 16
    truth = str(row.get("ground_truth", "")).strip()
    given = int(truth) if truth.isdigit() and len(truth) < 10 else 0
    secret = given if 1 <= given <= high else random.Random(row.get("seed")).randint(1, high)
    messages = [{"role": "user", "content": f"guess 1-{high}"}]
    while True:
        try:
            answer = client.chat.completions.create(model="policy", messages=messages)
        except Exception as err:  # noqa: BLE001 (openai.BadRequestError: no room left)
            if getattr(err, "status_code", None) == 400:
                return 0.0
            raise
        text = answer.choices[0].message.content or ""
        found = _NUMBER.search(text)
        if found is not None and int(found.group()) == secret:
            return 1.0
        hint = "say a number" if found is None else ("higher" if int(found.group()) < secret else "lower")
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": hint}]
