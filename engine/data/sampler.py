"""Which prompts each iteration takes: a shuffling sampler whose state checkpoints and resumes exactly.

    sampler = PromptSampler(n_rows=len(train), batch_size=cfg.data.train_batch_size, seed=cfg.data.seed)
    indices = sampler.next_indices()          # one iteration's rows
    state = sampler.state_dict()              # where it is: (epoch, step)
    ...
    resumed = PromptSampler(len(train), cfg.data.train_batch_size, cfg.data.seed)
    resumed.load_state_dict(state)            # goes on exactly where `sampler` was

Each epoch is a fresh permutation derived only from (seed, epoch), so the state needs no RNG bytes: the
epoch and the step within it say where to go on. The incomplete tail of an epoch is dropped, as verl's
dataloader does (`drop_last=True`), so every step has exactly `batch_size` rows.

The state always points at the next step to yield, and the step after an epoch's last is step 0 of the
next epoch. So resuming from a checkpoint taken right at an epoch boundary starts the next epoch; it can
never yield an empty step (the resume bug of stateful dataloaders that store "batches consumed" and
restart an exhausted epoch).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Any

from engine.errors import DataError

STATE_KEYS = ("seed", "epoch", "position", "steps", "n_rows", "batch_size", "shuffle")


class PromptSampler:
    """Row indices per training step, `batch_size` at a time, reshuffled every epoch, forever."""

    def __init__(self, n_rows: int, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if n_rows <= 0:
            raise DataError(f"the sampler needs at least one row, got n_rows={n_rows}")
        if batch_size <= 0:
            raise DataError(f"batch_size must be positive, got {batch_size}")
        if batch_size > n_rows:
            raise DataError(
                f"batch_size={batch_size} is larger than the dataset ({n_rows} rows after filtering); "
                "an epoch would have no complete step: lower data.train_batch_size or add rows"
            )
        self.n_rows = n_rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.steps_per_epoch = n_rows // batch_size  # the incomplete tail is dropped
        self.epoch = 0
        self.position = 0  # the next step within `epoch`, always < steps_per_epoch
        self.steps = 0  # steps yielded since the start of training (a check on epoch and position)
        self._order_of: tuple[int, list[int]] | None = None

    def next_indices(self) -> list[int]:
        """The rows of the next step; advances the state."""
        order = self.epoch_order(self.epoch)
        start = self.position * self.batch_size
        indices = order[start : start + self.batch_size]
        self.steps += 1
        self.position += 1
        if self.position == self.steps_per_epoch:  # roll over now, so the state never points past the end
            self.epoch, self.position = self.epoch + 1, 0
        return indices

    def __iter__(self) -> Iterator[list[int]]:
        """Steps forever (take as many as needed with itertools.islice); shares this sampler's state."""
        while True:
            yield self.next_indices()

    def epoch_order(self, epoch: int) -> list[int]:
        """All row indices in the order of `epoch`: the same in every process for (seed, epoch)."""
        if self._order_of is not None and self._order_of[0] == epoch:
            return self._order_of[1]
        order = list(range(self.n_rows))
        if self.shuffle:
            # A string seed is hashed with SHA-512 by random.Random, independent of PYTHONHASHSEED,
            # so every process and every Python 3 version derives the same permutation.
            random.Random(f"rlflow.sampler/{self.seed}/{epoch}").shuffle(order)
        self._order_of = (epoch, order)
        return order

    def seek(self, steps: int) -> None:
        """Go to the state after `steps` steps: iteration k of a run draws step k-1, whoever runs it."""
        if steps < 0:
            raise DataError(f"cannot seek the sampler to step {steps}")
        self.epoch, self.position = divmod(steps, self.steps_per_epoch)
        self.steps = steps

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: where to go on, plus the settings it is valid for."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "steps": self.steps,
            "n_rows": self.n_rows,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from `state`. Refuses a state made for other data or settings (the order would differ)."""
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise DataError(
                f"sampler state lacks {', '.join(missing)}; expected keys {', '.join(STATE_KEYS)}"
            )
        for key in ("n_rows", "batch_size", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise DataError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {key}={getattr(self, key)!r}; "
                    "resume with the same data and data settings as the checkpointed run"
                )
        epoch, position, steps = int(state["epoch"]), int(state["position"]), int(state["steps"])
        if position == self.steps_per_epoch:  # a state written at the very end of an epoch: next epoch
            epoch, position = epoch + 1, 0
        if (
            epoch < 0
            or not 0 <= position < self.steps_per_epoch
            or steps != epoch * self.steps_per_epoch + position
        ):
            raise DataError(
                f"sampler state is inconsistent: epoch={epoch}, position={position}, steps={steps} with "
                f"{self.steps_per_epoch} steps per epoch (steps must equal epoch * steps_per_epoch + position)"
            )
        self.epoch, self.position, self.steps = epoch, position, steps


def eval_batches(n_rows: int, batch_size: int) -> list[list[int]]:
    """Validation: every row once, in order, the last batch possibly shorter (nothing is dropped)."""
    if batch_size <= 0:
        raise DataError(f"batch_size must be positive, got {batch_size}")
    return [list(range(start, min(start + batch_size, n_rows))) for start in range(0, n_rows, batch_size)]
