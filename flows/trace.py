"""The run's timeline: every stage task's span and every rank's traced calls, as a Chrome / Perfetto
trace file in the run's storage, `trace/timeline.json` (open it in https://ui.perfetto.dev or
chrome://tracing).

    spans = TaskSpans()
    spans.add(iteration, "generate_rollouts", start, end)          # the iteration flows, as stages end
    write_timeline(store, run_id, spans, engine.drain_spans())     # when a flow run ends

Rows: "stages" has one row per iteration (overlapping iterations overlap there), and each worker
group ("policy", "rollout", "critic") one row per rank. A rank's call gets the iteration of the stage
span that contains it. Times are wall-clock seconds of the machine(s) that recorded them (one machine
here: one clock). A flow run adds its spans to those of the run's earlier flow runs; a flow run that
dies before its end leaves none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from infra.errors import ObjectNotFound
from infra.store import ObjectStore

TIMELINE = "trace/timeline.json"
# The stage whose task span holds each traced worker method.
_METHOD_STAGES = {
    "generate": ("generate_rollouts", "generate_baseline", "validate"),
    "compute_log_prob": ("compute_old_logprobs",), "compute_ref_log_prob": ("compute_ref_logprobs",),
    "compute_values": ("compute_values",), "update_actor": ("update_policy",), "update_critic": ("update_critic",),
    "send_weights": ("sync_weights",), "receive_weights": ("sync_weights",), "save": ("save_checkpoint",),
}


@dataclass
class TaskSpans:
    """The stage spans of this flow run (thread-safe enough: list.append)."""

    spans: list[dict[str, Any]] = field(default_factory=list)

    def add(self, iteration: int, stage: str, start: float, end: float) -> None:
        self.spans.append({"iteration": iteration, "stage": stage, "start": start, "end": end})


_SPANS: dict[str, TaskSpans] = {}  # run id -> the spans this process recorded for it


def spans_of(run_id: str) -> TaskSpans:
    """The stage spans of `run_id` recorded in this process (the train flow writes them at its end)."""
    return _SPANS.setdefault(run_id, TaskSpans())


def chrome_events(tasks: list[dict[str, Any]], ranks: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Trace events ("X": complete events, microseconds) of the stage spans and the ranks' calls."""
    events: list[dict[str, Any]] = []
    pids = {"stages": 1}
    for key in sorted(ranks):
        pids.setdefault(key.split("/")[0], len(pids) + 1)
    for name, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
    for span in tasks:
        events.append({"ph": "X", "pid": 1, "tid": span["iteration"], "name": span["stage"],
                       "ts": span["start"] * 1e6, "dur": (span["end"] - span["start"]) * 1e6,
                       "args": {"iteration": span["iteration"], "stage": span["stage"]}})
    for key, calls in sorted(ranks.items()):
        role, rank = key.split("/")
        for method, start, end in calls:
            iteration = _iteration_of(tasks, method, start, end)
            events.append({"ph": "X", "pid": pids[role], "tid": int(rank), "name": method, "ts": start * 1e6,
                           "dur": (end - start) * 1e6, "args": {"iteration": iteration, "rank": int(rank),
                                                                "role": role}})
    return events


def _iteration_of(tasks: list[dict[str, Any]], method: str, start: float, end: float) -> int | None:
    stages = _METHOD_STAGES.get(method, ())
    for span in tasks:
        if span["stage"] in stages and span["start"] <= start and end <= span["end"]:
            return int(span["iteration"])
    return None


def write_timeline(store: ObjectStore, run_id: str, tasks: TaskSpans, ranks: dict[str, list[Any]]) -> str:
    """Add this flow run's spans to the run's timeline.json (created if absent); returns its URL."""
    key = f"{run_id}/{TIMELINE}"
    try:
        events = json.loads(store.get_bytes(key))["traceEvents"]
    except ObjectNotFound:
        events = []
    known = {(e.get("pid"), e.get("name")) for e in events if e.get("ph") == "M"}
    for event in chrome_events(tasks.spans, ranks):
        if event["ph"] != "M" or (event["pid"], event["name"]) not in known:
            events.append(event)
    store.put_bytes(key, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}).encode())
    return store.url(key)


def busy_time(events: list[dict[str, Any]], start: float, end: float) -> float:
    """Seconds of [start, end] in which at least one rank runs a traced call (the union of the rank
    spans; stage spans are not compute). What is left is time in which no rank computes."""
    spans = sorted((max(start, e["ts"] / 1e6), min(end, (e["ts"] + e["dur"]) / 1e6)) for e in events
                   if e.get("ph") == "X" and e.get("pid") != 1)
    busy, cursor = 0.0, start
    for s, e in spans:
        if e <= cursor:
            continue
        busy += e - max(s, cursor)
        cursor = e
    return busy
