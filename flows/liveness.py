"""No run left "Running" by a dead process.

A controller that is SIGKILLed, or that exits on a lost Ray head (after Ray's GCS timeout) without
reporting, leaves its flow run "Running" in the UI for good. Three things end such runs:

- Heartbeats: `rlflow train` and `rlflow serve` run their flows with PREFECT_FLOWS_HEARTBEAT_FREQUENCY =
  HEARTBEAT_S (Prefect's minimum; its default is 180 s); a flow run then emits a
  `prefect.flow-run.heartbeat` event every HEARTBEAT_S while it runs (the iteration subflows do not).
- An automation on the Prefect server (created once, by name): an rlflow flow run (of the flows in
  FLOWS: other flows on the same server are left alone, their heartbeats may be slower) that emitted a
  heartbeat and then, for WINDOW_S, neither another heartbeat nor a final state, is set Crashed
  (Prefect's own recipe for zombie flow runs, docs.prefect.io "detect zombie flows").
- A resumed run marks the earlier "Running" flow runs of its run id, and their iteration subflows,
  Crashed, naming itself (flows/train.py `_crash_orphans`): that also covers the subflows, which have no
  heartbeat.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

logger = logging.getLogger(__name__)

HEARTBEAT_S = 30  # Prefect's minimum (MINIMUM_HEARTBEAT_INTERVAL)
# Six heartbeats missed. Three (90 s) was too few: on a loaded machine (two cores, two test workers, a
# retried run starting its Ray job) live runs were set Crashed twice with their process still running;
# a false "Crashed" on a live run is worse than a dead one noticed 90 s later.
WINDOW_S = 180
AUTOMATION = "rlflow: crash flow runs whose heartbeat stopped"
FLOWS = ["rlflow-train", "rlflow-scheduled"]


def enable_heartbeats() -> None:
    """Before Prefect's settings are (re)read: this process's flows emit a heartbeat every HEARTBEAT_S
    (the automation's window is made for it, so a slower one set by the user is replaced)."""
    os.environ["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = str(HEARTBEAT_S)


def ensure_crash_automation() -> None:
    """Create the zombie-run automation on the Prefect server, or update one of its name that an earlier
    version made with another window."""
    from prefect import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    try:
        with get_client(sync_client=True) as client:
            existing = client.read_automations_by_name(AUTOMATION)
            if existing and all(
                getattr(a.trigger, "within", None) == timedelta(seconds=WINDOW_S) for a in existing
            ):
                return
            automation = AutomationCore(
                name=AUTOMATION,
                description=f"A flow run that sent a heartbeat and then, for {WINDOW_S} s, neither another nor a "
                            "final state: its process died. Created by rlflow.",
                trigger=EventTrigger(
                    after={"prefect.flow-run.heartbeat"},
                    expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                            "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
                    match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
                    match_related=ResourceSpecification({"prefect.resource.role": "flow",
                                                         "prefect.resource.name": FLOWS}),
                    for_each={"prefect.resource.id"},
                    posture=Posture.Proactive,
                    threshold=1,
                    within=timedelta(seconds=WINDOW_S),
                ),
                actions=[ChangeFlowRunState(state=StateType.CRASHED, name="Crashed",
                                            message=f"no heartbeat for {WINDOW_S} s: its process died")],
            )  # fmt: skip
            if existing:
                for old in existing:
                    client.update_automation(old.id, automation)
            else:
                client.create_automation(automation)
    except Exception as err:  # the UI's states are a nicety: a run must not fail on it
        logger.warning("could not create the Prefect automation %r: %s", AUTOMATION, err)
