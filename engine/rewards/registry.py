"""The reward registry, dispatched on each row's data_source, and batched scoring with strict checks.

    batch = score_batch(data_sources, responses, ground_truths, extra_infos, cfg=cfg.reward)
    batch.scores          # one float per response
    batch.counts()        # e.g. {"right": 40, "wrong": 20, "timeout": 4} from rewards that report a status

A data_source picks its reward by exact name first, then by the longest registered prefix (verl's
`default_compute_score` dispatches on exact names). `reward.function` replaces the registry with one
custom row reward for every row, as verl's `custom_reward_function` does.

A reward with a format component (`RewardSpec.format_component`, reasoning_gym's) returns its "format"
(1.0 when the response is in the asked format, else 0.0) beside its "score"; the registry adds
`reward.format_weight` x format to the score.

A reward that raises, or returns NaN, inf or anything but a number (or a dict with a numeric "score"),
fails with a RewardError naming the reward, the data_source, the row and the value: a broken reward must
stop the stage, never turn into a silent 0 that the policy then learns from.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import RewardConfig
from engine.errors import ConfigError, RewardError
from engine.imports import load_object
from engine.rewards.humaneval import humaneval_reward
from engine.rewards.math_answer import math_score
from engine.rewards.python_expr import python_expr_reward
from engine.rewards.reasoning_gym import reasoning_gym_reward
from engine.rewards.rules import exact_match_score, format_score, gsm8k_score, sort_score
from engine.rewards.types import BatchReward, RewardItem, RowFailure, RowReward, SandboxLimits, per_row


@dataclass(frozen=True)
class RewardSpec:
    """A registered reward: its batch function and the data_sources it scores."""

    name: str
    fn: BatchReward
    sources: tuple[str, ...] = ()  # exact data_source names
    prefixes: tuple[str, ...] = ()  # data_source prefixes, e.g. "math/"
    # Its results carry "format" (0.0 or 1.0), which reward.format_weight weighs into the score.
    format_component: bool = False


REWARDS: dict[str, RewardSpec] = {}


def register_reward(spec: RewardSpec, *, replace: bool = False) -> RewardSpec:
    """Add a reward; a name, exact source or prefix another reward already has is refused."""
    if spec.name in REWARDS and not replace:
        raise RewardError(f"a reward named {spec.name!r} is already registered")
    for other in REWARDS.values():
        if other.name == spec.name:
            continue
        clash = set(spec.sources) & set(other.sources) or set(spec.prefixes) & set(other.prefixes)
        if clash:
            raise RewardError(
                f"reward {spec.name!r}: {', '.join(sorted(clash))} already belongs to {other.name!r}"
            )
    REWARDS[spec.name] = spec
    return spec


for _spec in (
    RewardSpec("gsm8k", per_row(gsm8k_score), ("openai/gsm8k", "rlflow/arith", "rlflow/calc"), ("gsm8k/",)),
    RewardSpec(
        "math",
        per_row(math_score),
        ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "rlflow/math"),
        ("math/",),
    ),
    RewardSpec("exact", per_row(exact_match_score), ("rlflow/exact",), ("exact/",)),
    RewardSpec("format", per_row(format_score), ("rlflow/format",), ("format/",)),
    RewardSpec("sort", per_row(sort_score), ("rlflow/sort",), ("sort/",)),
    RewardSpec("python_expr", python_expr_reward, ("rlflow/countdown",), ("countdown/", "python_expr/")),
    RewardSpec("reasoning_gym", reasoning_gym_reward, (), ("reasoning_gym/",), format_component=True),
    RewardSpec("humaneval", humaneval_reward, (), ("humaneval/",)),
):
    register_reward(_spec)


def resolve_reward(data_source: str, row: int | None = None) -> RewardSpec:
    """The reward of `data_source`: an exact name, else the longest matching prefix."""
    for spec in REWARDS.values():
        if data_source in spec.sources:
            return spec
    matches = [
        (len(p), spec) for spec in REWARDS.values() for p in spec.prefixes if data_source.startswith(p)
    ]
    if matches:
        return max(matches, key=lambda m: m[0])[1]
    where = f" (row {row})" if row is not None else ""
    names = sorted(s for spec in REWARDS.values() for s in spec.sources)
    prefixes = sorted(p + "*" for spec in REWARDS.values() for p in spec.prefixes)
    raise RewardError(
        f"no reward for data_source {data_source!r}{where}; registered: {', '.join(names + prefixes)}; "
        "or set reward.function to a custom 'module:function' / 'file.py:function'"
    )


# ------------------------------------------------------------------------------- custom rewards


def load_custom_reward(spec: str) -> RowReward:
    """`module:function` or `path/to/file.py:function`, with verl's compute_score signature."""
    return load_object(spec, "reward.function", RewardError)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------- batch scoring


@dataclass(frozen=True)
class RewardBatch:
    """Scores of a batch in row order; `info` holds what dict-returning rewards gave besides "score"."""

    scores: list[float]
    info: list[dict[str, Any]] = field(default_factory=list)

    def counts(self, key: str = "status") -> dict[str, int]:
        """How many rows reported each value of `key` (e.g. sandbox timeouts)."""
        return dict(Counter(str(row[key]) for row in self.info if key in row))


def score_batch(
    data_sources: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
    *,
    cfg: RewardConfig | None = None,
    row_offset: int = 0,
) -> RewardBatch:
    """Score `responses` against their rows' ground truths; one finite float per response.

    Rows that share a reward are scored in one call (a sandboxed reward starts one process for them).
    `row_offset` is the index of the first row in the whole batch, so that messages from a chunk name
    the row of the batch.
    """
    cfg = cfg or RewardConfig()
    n = len(responses)
    extra_infos = extra_infos if extra_infos is not None else [None] * n
    if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
        raise ValueError(
            f"columns differ in length: {len(data_sources)} data_sources, {n} responses, "
            f"{len(ground_truths)} ground_truths, {len(extra_infos)} extra_infos"
        )
    items = [RewardItem(*fields) for fields in zip(data_sources, responses, ground_truths, extra_infos)]
    scores: list[float] = [0.0] * n
    info: list[dict[str, Any]] = [{} for _ in range(n)]
    for spec, rows in _group_rows(items, cfg, row_offset):
        raw = _call_reward(spec, [items[i] for i in rows], rows, SandboxLimits.from_config(cfg), row_offset)
        for i, value in zip(rows, raw):
            scores[i], info[i] = _as_score(value, spec.name, items[i].data_source, row_offset + i)
            if spec.format_component:
                scores[i] += cfg.format_weight * _format_value(info[i], spec.name, items[i].data_source,
                                                               row_offset + i)
    return RewardBatch(scores, info)


def check_format_weight(cfg: RewardConfig, data_sources: Iterable[str]) -> None:
    """reward.format_weight other than 0 is refused where it would change nothing: reward.function replaces
    the registry, or no data_source's reward has a format component."""
    if not cfg.format_weight:
        return
    if cfg.function is not None:
        raise ConfigError(f"reward.format_weight={cfg.format_weight} weighs a registered reward's format component, "
                          f"and reward.function={cfg.function} replaces the registry: leave it at 0")
    names = sorted({resolve_reward(source).name for source in set(data_sources)})
    if not any(REWARDS[name].format_component for name in names):
        having = ", ".join(p + "*" for spec in REWARDS.values() if spec.format_component for p in spec.prefixes)
        raise ConfigError(f"reward.format_weight={cfg.format_weight} weighs a reward's format component, and the "
                          f"data's rewards ({', '.join(names)}) have none (those of {having} have): leave it at 0")


def _format_value(info: Mapping[str, Any], reward: str, data_source: str, row: int) -> float:
    value = info.get("format")
    if isinstance(value, bool) or value not in (0, 1):
        raise RewardError(f"reward {reward!r} for data_source {data_source!r} returned format {_short(value)} at row "
                          f"{row}; a reward with a format component returns 0.0 or 1.0 under 'format'")
    return float(value)


def _group_rows(
    items: Sequence[RewardItem], cfg: RewardConfig, row_offset: int
) -> list[tuple[RewardSpec, list[int]]]:
    if cfg.function:
        custom = RewardSpec(cfg.function, per_row(load_custom_reward(cfg.function)))
        return [(custom, list(range(len(items))))] if items else []
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(resolve_reward(item.data_source, row_offset + i).name, []).append(i)
    return [(REWARDS[name], rows) for name, rows in groups.items()]


def _call_reward(
    spec: RewardSpec, items: list[RewardItem], rows: list[int], limits: SandboxLimits, row_offset: int
) -> Sequence[object]:
    try:
        raw = spec.fn(items, limits)
    except RowFailure as failure:
        row, item = rows[failure.index], items[failure.index]
        cause = failure.cause
        raise RewardError(
            f"reward {spec.name!r} for data_source {item.data_source!r} raised at row {row_offset + row}: "
            f"{type(cause).__name__}: {cause}"
        ) from cause
    except RewardError:
        raise
    except Exception as err:
        sources = ", ".join(sorted({item.data_source for item in items}))
        raise RewardError(
            f"reward {spec.name!r} for data_source {sources} raised on rows {row_offset + rows[0]}.."
            f"{row_offset + rows[-1]}: {type(err).__name__}: {err}"
        ) from err
    if len(raw) != len(items):
        raise RewardError(f"reward {spec.name!r} returned {len(raw)} results for {len(items)} rows")
    return raw


def _as_score(value: object, reward: str, data_source: str, row: int) -> tuple[float, dict[str, Any]]:
    """A finite float (and the other keys of a dict result), or a RewardError naming the value."""
    extra: dict[str, Any] = {}
    score = value
    if isinstance(value, Mapping):
        if "score" not in value:
            raise RewardError(
                f"reward {reward!r} for data_source {data_source!r} returned a dict without 'score' at row "
                f"{row}: {_short(value)}; a dict result needs a finite number under 'score'"
            )
        score = value["score"]
        extra = {k: v for k, v in value.items() if k != "score"}
    if not isinstance(score, numbers.Real) or not math.isfinite(float(score)):
        raise RewardError(
            f"reward {reward!r} for data_source {data_source!r} returned {_short(score)} at row {row}; "
            "a reward must be a finite number (or a dict with a finite number under 'score')"
        )
    return float(score), extra


def _short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
