"""The types every reward shares: one scored item, the sandbox limits, and the one batch signature."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from engine.config import RewardConfig


@dataclass(frozen=True)
class RewardItem:
    """One response to score, with its prompt row's reward fields."""

    data_source: str
    response: str
    ground_truth: Any
    extra_info: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class SandboxLimits:
    """Limits on one generated program run by a reward (engine.rewards.sandbox); defaults: RewardConfig."""

    timeout_s: float
    memory_mb: int
    isolation: Literal["bwrap", "none"] = "bwrap"  # "none": the child runs as this user, unconfined

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> SandboxLimits:
        return cls(timeout_s=cfg.sandbox_timeout_s, memory_mb=cfg.sandbox_memory_mb, isolation=cfg.sandbox.isolation)


class RowReward(Protocol):
    """verl's `compute_score` signature: a float, or a dict with a "score" and other per-row info."""

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
    ) -> object: ...


# Every registered reward has this one signature: items in, one raw result per item out (a number, or a
# dict with "score"). Row rewards are lifted into it by `per_row`; rewards that run code take the whole
# batch so that one sandbox process serves many items.
BatchReward = Callable[[Sequence[RewardItem], SandboxLimits], Sequence[object]]


class RowFailure(Exception):
    """Raised by a batch reward to say which item (index in its batch) broke it, and why."""

    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(f"item {index}: {type(cause).__name__}: {cause}")
        self.index = index
        self.cause = cause


def per_row(fn: RowReward) -> BatchReward:
    """Lift a row reward into the batch signature; an exception names the item it came from.

    Arguments go by keyword, as verl's reward manager passes them, so a verl `compute_score` works as is.
    """

    def batch(items: Sequence[RewardItem], limits: SandboxLimits) -> list[object]:
        results: list[object] = []
        for i, item in enumerate(items):
            try:
                results.append(
                    fn(
                        data_source=item.data_source,
                        solution_str=item.response,
                        ground_truth=item.ground_truth,
                        extra_info=item.extra_info,
                    )
                )
            except Exception as err:  # a bug in the reward or bad ground truth: reported, never a 0
                raise RowFailure(i, err) from err
        return results

    batch.__name__ = getattr(fn, "__name__", "reward")
    batch.__qualname__ = batch.__name__
    return batch
