"""The asynchronous schedule (trainer.max_staleness = k >= 1, placement.mode=split): iterations overlap,
and which weights each rollout uses is decided by the schedule, never by timing.

    rollout of i        generates with version max(0, i-1-k)     (the rollout pool holds exactly that)
    training stages of i start when iteration i-1 is committed (metrics, validation, checkpoint)
    weight sync of i    waits for the rollout of i+k (the last one that needs version i-1)
    iteration i starts  when iteration i-1-k is committed (its weights are in the rollout pool)

So with k = 1 the rollout of i+1 runs on the rollout pool while i computes log-probs and updates on
the training pool.

Partial rollouts (rollout.partial_tokens = P) cut each rollout in two by token count, never by time:

    first part of i     its first P tokens a response, with version max(0, i-1-k)
    second part of i    the responses still going, on to rollout.max_new_tokens, with version max(0, i-k):
                        it waits for the weight sync of iteration i-k
    weight sync of i    waits for the first part of i+k and the second part of i+k-1 (both use version i-1)

A version stays in the rollout pool until both are done with it, so at the commit of i the first parts
up to i+k and the second parts up to i+k-1 are in storage, and a resume needs no older weights. Each iteration is still one `rl-iteration` flow run, run in its own thread here, so
overlapping iterations overlap in the Prefect UI. When iteration i is committed, the rollouts up to
i+k are in storage and the rollout pool holds version i: a run that stops or dies there resumes from a
checkpoint without needing any older weights (the rollout buffers are reused, the pool is synced to i).

A run that ends before total_iterations (iterations_per_run, a stop request) still generates the
rollouts of the next k iterations ("prefetch": their flow runs stop before their training stages), so
the next flow run finds them. A failure in any iteration aborts the others; the train flow restarts
the engine if needed and runs the schedule again from the last committed iteration, reusing every
finished stage.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

_SCHEDULES: dict[str, Schedule] = {}  # run id -> the live schedule of this process (read by rl_iteration)


class Aborted(RuntimeError):
    """Another iteration of the schedule failed: this one stops where it waits."""


@dataclass
class Schedule:
    run_id: str
    k: int
    first: int  # the first iteration of this flow run (earlier ones are committed)
    last: int  # the last iteration this flow run commits (a stop request lowers it)
    total: int  # trainer.total_iterations
    partial: bool = False  # rollout.partial_tokens: each rollout in two parts (below)
    committed: set[int] = field(default_factory=set)
    rolled: set[int] = field(default_factory=set)  # iterations whose rollout stage (its first part) has ended
    continued: set[int] = field(default_factory=set)  # partial rollouts: iterations whose second part has ended
    synced: set[int] = field(default_factory=set)  # iterations whose weight sync has ended
    training: set[int] = field(default_factory=set)  # iterations past their wait for training
    errors: dict[int, BaseException] = field(default_factory=dict)
    abort: threading.Event = field(default_factory=threading.Event)
    changed: threading.Condition = field(default_factory=threading.Condition)

    # -- what the iteration flows call -------------------------------------------------------------
    def before_training(self, iteration: int) -> bool:
        """Wait until iteration-1 is committed; False when this iteration only prefetches its rollout
        (it lies beyond the flow run's last iteration)."""
        self._wait(lambda: iteration - 1 < self.first or iteration - 1 in self.committed,
                   f"iteration {iteration - 1} to be committed")
        with self.changed:
            if iteration > self.last:
                return False
            self.training.add(iteration)
            return True

    def before_sync(self, iteration: int) -> None:
        """Wait until the rollout of iteration+k has ended (it needs the weights the sync replaces); with
        partial rollouts, its first part, and the second part of iteration+k-1's (both use them)."""
        later = iteration + self.k
        if later <= self.total:
            self._wait(lambda: later in self.rolled, f"the rollout of iteration {later}")
        if self.partial and self.first <= later - 1 <= self.total:
            self._wait(lambda: later - 1 in self.continued, f"the continued rollout of iteration {later - 1}")

    def before_continue(self, iteration: int) -> None:
        """Partial rollouts: wait until the rollout pool holds version iteration-k (its sync has ended; one
        before this flow run's first iteration is there already: the engine was synced to it)."""
        version = iteration - self.k
        self._wait(lambda: version < self.first or version in self.synced, f"the weight sync of iteration {version}")

    def ended(self, task: str, iteration: int) -> None:
        """Stage `task` of `iteration` has ended (flows.train._on_end)."""
        where = {"generate_rollouts": self.rolled, "continue_rollouts": self.continued, "sync_weights": self.synced}
        self._note(where[task], iteration)

    def fail(self, iteration: int, err: BaseException) -> None:
        """Iteration `iteration` failed: every wait of the schedule stops (Aborted)."""
        with self.changed:
            self.errors.setdefault(iteration, err)
            self.abort.set()
            self.changed.notify_all()

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        with self.changed:
            while not ready():
                if self.abort.is_set():
                    raise Aborted(f"stopped waiting for {what}: another iteration of run {self.run_id} failed")
                self.changed.wait(timeout=1.0)

    def _note(self, where: set[int], iteration: int) -> None:
        with self.changed:
            where.add(iteration)
            self.changed.notify_all()

    # -- what the runner does ----------------------------------------------------------------------
    def may_start(self, iteration: int) -> bool:
        """Iteration i starts once i-1-k is committed, up to k iterations past the last (prefetch)."""
        return (iteration <= min(self.total, self.last + self.k)
                and (iteration - 1 - self.k < self.first or iteration - 1 - self.k in self.committed))

    def request_stop(self) -> None:
        """Commit the iterations already training, start no other: the later ones prefetch only."""
        with self.changed:
            self.last = max([self.first - 1, *self.committed, *self.training])
            self.changed.notify_all()


def run_schedule(schedule: Schedule, run_one: Callable[[int], dict[str, float] | None],
                 on_commit: Callable[[int], None], stop_requested: Callable[[], bool],
                 on_failure: Callable[[BaseException], None]) -> None:
    """Run iterations schedule.first..schedule.last (and the prefetches after) in threads, each in a copy
    of this thread's context (so each iteration flow is a subflow of the train flow). `run_one(i)` runs
    and commits iteration i (None: it only prefetched). Raises the failure of the earliest failed
    iteration after every thread has ended; `on_failure(err)` first, once, so that the caller can free
    threads blocked on the engine (by stopping it when it is broken)."""
    threads: dict[int, threading.Thread] = {}
    next_start = schedule.first
    stop_seen = False
    _SCHEDULES[schedule.run_id] = schedule
    reported = schedule.first - 1

    def body(iteration: int) -> None:
        try:
            if run_one(iteration) is not None:
                schedule._note(schedule.committed, iteration)
        except BaseException as err:  # noqa: BLE001 - every failure ends the schedule
            schedule.errors.pop(iteration, None)  # the flow's own error, not the watcher's summary
            schedule.fail(iteration, err)
        finally:
            with schedule.changed:
                schedule.changed.notify_all()

    try:
        while True:
            if stop_requested() and not stop_seen:
                stop_seen = True
                schedule.request_stop()
            with schedule.changed:
                while not schedule.abort.is_set() and next_start <= schedule.total and schedule.may_start(next_start):
                    thread = threading.Thread(target=contextvars.copy_context().run, args=(body, next_start),
                                              name=f"rlflow-iteration-{next_start}", daemon=True)
                    threads[next_start] = thread
                    thread.start()
                    next_start += 1
                done = all(i in schedule.committed for i in range(schedule.first, schedule.last + 1))
                alive = [t for t in threads.values() if t.is_alive()]
                if schedule.abort.is_set() or (done and not alive):
                    break
                schedule.changed.wait(timeout=1.0)
            while reported + 1 in schedule.committed:  # in order, from this (the flow's) thread
                reported += 1
                on_commit(reported)
        if schedule.errors:
            on_failure(next(iter(schedule.errors.values())))
        for thread in threads.values():
            thread.join()
        while reported + 1 in schedule.committed:
            reported += 1
            on_commit(reported)
        if schedule.errors:
            real = {i: e for i, e in schedule.errors.items() if not isinstance(e, Aborted)}
            first = min(real or schedule.errors)
            raise (real or schedule.errors)[first]
    finally:
        _SCHEDULES.pop(schedule.run_id, None)


def schedule_of(run_id: str) -> Schedule | None:
    """The schedule running `run_id` in this process; None: the on-policy loop, one iteration at a time."""
    return _SCHEDULES.get(run_id)
