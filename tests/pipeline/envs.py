"""Environments for the tests (rollout.env=tests/pipeline/envs.py:NAME): one that works and shows its
process is its own, and one for each way an environment can go wrong. Imports nothing of rlflow's (each
episode's sandbox child imports this file)."""

from __future__ import annotations

import os
import time

BUILT = 0  # how many instances this process built: 1 in every episode's own process


class Counter:
    """Three steps of reward 0.25 each, then done; each observation says the step, how many instances its
    process built, and whether a file another episode wrote in /tmp is there."""

    def __init__(self) -> None:
        global BUILT
        BUILT += 1
        self.n = 0

    def init(self, row: dict) -> list[dict]:
        seen = os.path.exists("/tmp/rlflow-test-mark")
        with open("/tmp/rlflow-test-mark", "w") as f:
            f.write(str(row["seed"]))
        return [{"role": "user", "content": f"count {row['ground_truth']}{' seen' if seen else ''}"}]

    def step(self, assistant_text: str) -> tuple:
        self.n += 1
        print("garbage the trainer must never read")  # stdout is not the answers' channel
        return [{"role": "user", "content": f"step {self.n} of {BUILT} [{assistant_text}]"}], 0.25, self.n == 3, \
            {"n": self.n}


class _BadRow(Counter):
    """A Counter that goes wrong (`wrong`) on the row whose ground truth is "bad", and works on the others."""

    def init(self, row: dict) -> list[dict]:
        self.bad = row["ground_truth"] == "bad"
        return super().init(row)

    def step(self, assistant_text: str) -> tuple:
        return self.wrong() if self.bad else super().step(assistant_text)

    def wrong(self) -> tuple:
        raise NotImplementedError


class HangsOnSecondStep(_BadRow):
    def step(self, assistant_text: str) -> tuple:
        if self.bad and self.n == 1:
            time.sleep(3600)
        return Counter.step(self, assistant_text)


class Slow(Counter):
    """Every step takes 0.6 s."""

    def step(self, assistant_text: str) -> tuple:
        time.sleep(0.6)
        return super().step(assistant_text)


class HangsInInit(Counter):
    def init(self, row: dict) -> list[dict]:
        time.sleep(3600)
        return []


class Raises(_BadRow):
    def wrong(self) -> tuple:
        raise ValueError("no such move")


class WrongShape(_BadRow):
    def wrong(self) -> tuple:
        return "higher"  # type: ignore[return-value]


class Exits(_BadRow):
    def wrong(self) -> tuple:
        os._exit(3)


class Huge(_BadRow):
    def wrong(self) -> tuple:
        self.ballast = bytearray(1 << 30)  # over the address-space cap
        return [], 0.0, True, {}


class NoStep:
    def init(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": "x"}]


class NeedsArguments(Counter):
    def __init__(self, size: int) -> None:
        super().__init__()


def not_a_class(row: dict) -> list[dict]:
    return [{"role": "user", "content": "x"}]


from engine.rollout.builtin_envs import GuessNumber  # noqa: E402  (no torch, no pydantic: tests/test_layers.py)


class GuessOrHang(GuessNumber):
    """GuessNumber with a cost of 0.125 a guess (a reward at every step, not only the last), whose
    episodes with a seed divisible by 4 hang in their second step: in a run, those episodes end at
    rollout.multi_turn.env_step_timeout_s as errors, and the iteration goes on."""

    def init(self, row: dict) -> list[dict]:
        self.hangs = row["seed"] % 4 == 0
        return super().init(row)

    def step(self, assistant_text: str) -> tuple:
        if self.hangs and self.guesses >= 1:
            time.sleep(3600)
        observations, reward, done, info = super().step(assistant_text)
        return observations, reward - 0.125, done, info
