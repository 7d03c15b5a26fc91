"""What an iteration's stages are, as data: the declared graph the iteration flow submits.

    StageSpec(name="score_rewards", task="score_rewards", reads=[...], writes=[...], buffer="reward")

`flows/algorithms.py` declares the list for a config (and checks it before launch); `flows/train.py`
submits exactly that list, each stage's inputs being the stages that wrote what it reads. A stage
gets a Batch of its declared reads only, and its buffer must hold exactly its declared writes.

A user's own stage (a second reward, a filter, a metric) is a declaration too:

    # my_stages.py
    from tasks.graph import stage

    @stage(reads=("response_text",), writes=("politeness",), reward_weight=0.1)
    def politeness(batch):                       # Batch of the declared reads -> Batch of the writes
        return Batch({"politeness": torch.tensor([...])}, {})

and `algorithm.extra_stages=[my_stages.py:politeness]` in the config. A stage with a `reward_weight`
writes one score per response, which the advantage stage adds (times the weight) to the reward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from engine.batch import Batch
from engine.errors import ConfigError
from engine.imports import load_object


class StageSpec(BaseModel):
    """One stage of the iteration as the flow submits it (JSON-able: it travels in the RunPlan)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str  # the Prefect task's name, unique in the iteration
    task: str  # the stage function: a built-in stage name, or "user"
    reads: tuple[str, ...]  # the columns of the Batch the stage gets
    writes: tuple[str, ...]  # the columns of the buffer it writes (nothing: it changes the engine)
    buffer: str | None = None  # the buffer's name under buffers/iter_NNNNNN/
    engine: bool = False  # calls the engine's actors: such stages run one at a time, in declared order
    sources: dict[str, tuple[str, ...]] = {}  # upstream stage -> the columns read from its buffer
    after: tuple[str, ...] = ()  # stages it waits for without reading them (the previous engine stage)
    function: str | None = None  # a user stage: 'module:name' or 'file.py:name' of its function
    reward_weight: float | None = None  # a user stage's score, added to the reward with this weight

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(self.sources)


@dataclass(frozen=True)
class UserStage:
    """The declaration the `stage` decorator attaches to a user's stage function."""

    reads: tuple[str, ...]
    writes: tuple[str, ...]
    reward_weight: float | None = None


UserStageFn = Callable[[Batch], Batch]


def stage(*, reads: tuple[str, ...], writes: tuple[str, ...], reward_weight: float | None = None
          ) -> Callable[[UserStageFn], UserStageFn]:
    """Declare `fn` (Batch of `reads` -> Batch of `writes`) as a stage for `algorithm.extra_stages`."""
    def declare(fn: UserStageFn) -> UserStageFn:
        fn.rlflow_stage = UserStage(tuple(reads), tuple(writes), reward_weight)  # type: ignore[attr-defined]
        return fn
    return declare


def load_user_stage(spec: str) -> tuple[UserStageFn, UserStage]:
    """The function named by an `algorithm.extra_stages` entry and its declaration; ConfigError else."""
    fn = load_object(spec, "algorithm.extra_stages", ConfigError)
    declared = getattr(fn, "rlflow_stage", None)
    if not isinstance(declared, UserStage):
        raise ConfigError(f"algorithm.extra_stages {spec!r}: {getattr(fn, '__name__', spec)} is not declared "
                          "as a stage; decorate it with @tasks.graph.stage(reads=..., writes=...)")
    if declared.reward_weight is not None and len(declared.writes) != 1:
        raise ConfigError(f"algorithm.extra_stages {spec!r}: a stage with a reward_weight writes exactly one "
                          f"column (its score per response), not {list(declared.writes)}")
    return fn, declared
