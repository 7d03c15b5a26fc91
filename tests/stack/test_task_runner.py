"""tasks.runner.StageTaskRunner on a real stack: tasks run under the flow's Prefect settings (also
when they change between flows served by the same Ray worker), are recorded under their flow run,
and pass results along."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@pytest.mark.slow
@pytest.mark.integration
def test_tasks_follow_the_flows_settings_and_are_recorded_under_their_flow(stack_home: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RAY_"))}
    env["PYTHONPATH"] = str(REPO)
    probe = subprocess.run([sys.executable, str(HERE / "runner_probe.py"), str(stack_home)],
                           capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    runs = json.loads(probe.stdout.strip().splitlines()[-1])
    assert [r["flow_state"] for r in runs] == ["COMPLETED", "COMPLETED"]
    for run in runs:
        first, second = run["tasks"]
        assert (first["value"], second["value"]) == (run["retries"] * 10 + 1, run["retries"] * 10 + 2)
        for t in run["tasks"]:
            assert t["retries_setting"] == run["retries"], t  # the settings of this flow, not a cached older one
            assert t["server_flow_run_id"] == run["flow_run_id"] and t["server_state"] == "COMPLETED"
    # Ray reuses its idle worker: one process served both flows, so the second flow's settings had to
    # replace the first's in that worker.
    assert {t["pid"] for t in runs[0]["tasks"]} & {t["pid"] for t in runs[1]["tasks"]}
