"""Retry of a failed deployed run by pressing the real button in the real Prefect UI in headless
Chromium, logged in on the UI's login page with the stack's auth string (where Chromium is missing: through the API call the button makes,
`set_flow_run_state(id, AwaitingRetry())`). The flow runs again, every finished stage of the failed iteration comes
back `Cached` (its buffer untouched), the live engine carries on, and the run completes. The run's
rollouts are an agent's episodes (rollout.agent: engine.rollout.builtin_agents:guess_number, written
against the openai client), so Retry is shown with an agent: its episodes are not played again. After the
UI retry, the completed run's pages as Chromium renders them: the summary's charts, no pile of
per-iteration tables on the run's page, the user's own stage among the iteration's task runs, and the
iteration's episodes table.

Chromium: Debian's, at /usr/bin/chromium (.ci/run installs it). Without it these tests say so in one
line and are skipped, except where RLFLOW_UI_TESTS=required (CI), where they fail."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ops.conftest import (
    NEVER,
    REWARD,
    Server,
    flow_logs,
    run_args,
    serving,
    subflow_runs,
    task_states,
    trigger,
    wait_for,
)
from tests.services import Cli, WarmCli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REUSED = ("generate_rollouts", "score_rewards", "compute_old_logprobs", "compute_advantages")
# update_policy of iteration 2 fails on every attempt of the first flow run (the task's own retries
# included), then passes: the count is kept in storage (tasks/faults.py).
FAULT = ["debug.fail_stage=update_policy", "debug.fail_times=3", "debug.fail_iteration=2",
         "trainer.stage_retry_delays_s=[0,0]"]
# The runs train LoRA adapters: Retry of a LoRA run (full fine-tuning's Retry is the same flow path).
LORA = ["actor.lora.rank=4", "actor.lora.alpha=8"]
STAGE = f"algorithm.extra_stages={Path(__file__).resolve().parents[1] / 'pipeline' / 'stages.py'}:brevity"
# An agent plays the rollouts (its reward replaces the rule's): 4 prompts x 4 episodes, two turns each;
# two optimizer steps an iteration (so the old log-prob pass runs).
AGENT = ["rollout.multi_turn.enable=true", "rollout.agent=engine.rollout.builtin_agents:guess_number",
         "rollout.multi_turn.max_turns=2", "rollout.max_new_tokens=24", "data.max_prompt_length=32",
         "data.train_batch_size=4", "rollout.n=4", "actor.mini_batch_size=8", "actor.micro_batch_size=8"]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def chromium() -> str:
    import os

    if not Path(CHROMIUM).exists():
        message = f"Chromium not found at {CHROMIUM}: install Debian's chromium (apt-get install chromium) to run the UI tests"
        if os.environ.get("RLFLOW_UI_TESTS") == "required":
            pytest.fail(message)
        pytest.skip(message)
    return CHROMIUM


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("retry-runs")


@pytest.fixture(scope="module")
def server(cli: Cli, warm_cli: WarmCli, tiny_model_dir: Path, root: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Server]:
    """The deployment of a failing run that the module's one running test retries (retry-ui where Chromium
    is here, else retry-api), served for the module."""
    name = "retry-ui" if Path(CHROMIUM).exists() else "retry-api"
    args = [a for a in run_args(tiny_model_dir, root, "trainer.iterations_per_run=2", STAGE, *FAULT, *LORA, *AGENT)
            if a != REWARD]
    proc = warm_cli("deploy", *args, "--name", name, "--cron", NEVER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with serving(cli, [name], tmp_path_factory.mktemp("serve-home")) as served:
        yield served
    warm_cli("engine", "stop", name)


def failed_run(prefect: Any, server: Server, name: str, root: Path) -> tuple[Any, tuple[int, bytes]]:
    """Trigger a run of `name`, wait until it failed; (the flow run, the failed iteration's rollout buffer)."""
    run = wait_for(prefect, trigger(prefect, name).id, lambda s: s.is_final(), server)
    assert run.state.is_failed(), f"{run.state.name}: {run.state.message}\n{server.tail()}"
    assert (root / name / "metrics" / "iter_000001.json").exists()
    assert not (root / name / "metrics" / "iter_000002.json").exists()
    rollout = root / name / "buffers" / "iter_000002" / "rollout.parquet"
    return run, (rollout.stat().st_mtime_ns, rollout.read_bytes())


def assert_retried(prefect: Any, server: Server, run: Any, root: Path, rollout: tuple[int, bytes]) -> None:
    """The retried flow run completes in a new `train` subflow run that reused the stages."""
    done = wait_for(prefect, run.id, lambda s: s.is_final() and s.name != "AwaitingRetry", server)
    assert done.state.is_completed(), f"{done.state.name}: {done.state.message}\n{server.tail()}"
    assert done.run_count == 2
    first, retried = subflow_runs(prefect, run.id)  # the train flow runs: the failed one and the retry's
    assert first.state.is_failed() and retried.state.is_completed()
    assert retried.parameters["resume"] == run.parameters["lineage"]
    iteration = [r for r in subflow_runs(prefect, retried.id) if r.name == "iter-000002"]
    assert len(iteration) == 1
    states = task_states(prefect, iteration[0].id, (*REUSED, "update_policy"))
    assert {stage: states.get(stage) for stage in REUSED} == dict.fromkeys(REUSED, "Cached"), states
    assert states.get("update_policy") == "Completed", states
    name = run.parameters["lineage"]
    path = root / name / "buffers" / "iter_000002" / "rollout.parquet"
    assert (path.stat().st_mtime_ns, path.read_bytes()) == rollout  # not regenerated
    metrics = [json.loads((root / name / "metrics" / f"iter_{i:06d}.json").read_text()) for i in (1, 2)]
    assert metrics[1]["stages/reused"] >= len(REUSED)
    assert all("actor/pg_loss" in m for m in metrics)
    assert "attached to the live engine" in flow_logs(prefect, [retried.id])  # the engine carried on
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(root / name / "checkpoints" / "step_000002" / "policy")).read_metadata()
    weights = [k for k in keys.state_dict_metadata if k.startswith("model.")]
    assert weights and all("lora_" in k for k in weights)  # the retried run committed adapters only


def test_retry_through_the_api(prefect: Any, server: Server, root: Path) -> None:
    """Where Chromium is missing: the call the Retry button makes. Where it is there, the button test
    below makes that same call by pressing the button and asserts all of this and more (one failed run
    of ~90 s saved)."""
    from prefect.states import AwaitingRetry

    if Path(CHROMIUM).exists():
        pytest.skip("Chromium is here: test_retry_button_in_the_ui retries through the real button")

    run, rollout = failed_run(prefect, server, "retry-api", root)
    result = prefect.set_flow_run_state(run.id, AwaitingRetry(message="retried by the test"))
    assert result.status.value == "ACCEPT", result
    assert_retried(prefect, server, run, root, rollout)


def log_in(page: Any, ui: str, password: str, shot: Path) -> None:
    """The stack's API requires its auth string: the UI opens on its login page (a screenshot of it), and
    the password is typed there as a user does."""
    page.goto(ui, wait_until="networkidle")
    field = page.get_by_placeholder("admin:pass")  # the login page: nothing else is shown without the password
    field.wait_for(timeout=30_000)
    assert "/login" in page.url, page.url
    page.screenshot(path=str(shot))
    field.fill(password)
    page.get_by_role("button", name="Login").click()
    page.wait_for_url(lambda url: "/login" not in url, timeout=30_000)


def test_retry_button_in_the_ui(prefect: Any, server: Server, root: Path, api_url: str, stack_home: Path,
                                tmp_path: Path, chromium: str) -> None:
    """The UI's login page, the failed run's page in the UI, a screenshot of it (flow-run-failed.png), the
    Retry button pressed; then the completed run as the UI renders it (see the module's docstring)."""
    from playwright.sync_api import sync_playwright

    from infra.stack import prefect_auth_path, read_prefect_auth

    password = read_prefect_auth(prefect_auth_path(stack_home))
    run, rollout = failed_run(prefect, server, "retry-ui", root)
    ui = api_url.removesuffix('/api')
    page_url = f"{ui}/runs/flow-run/{run.id}"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        try:
            log_in(page, ui, password, tmp_path / "login.png")
            page.goto(page_url, wait_until="networkidle")
            page.get_by_text(run.name).first.wait_for(timeout=60_000)
            page.screenshot(path=str(tmp_path / "flow-run-failed.png"))
            page.get_by_role("button", name="Retry", exact=True).click(timeout=30_000)
            dialog = page.get_by_role("dialog").filter(has_text=f"Retry {run.name}?")  # the UI asks first
            dialog.wait_for(timeout=10_000)
            page.screenshot(path=str(tmp_path / "retry-dialog.png"))
            dialog.get_by_role("button", name="Retry", exact=True).click()
            wait_for(prefect, run.id, lambda s: s.name != "Failed", server, timeout_s=30)
            page.screenshot(path=str(tmp_path / "flow-run-retried.png"))
        except Exception:
            page.screenshot(path=str(tmp_path / "ui-failure.png"))
            (tmp_path / "ui-failure.html").write_text(page.content())
            raise
        finally:
            browser.close()
    assert_retried(prefect, server, run, root, rollout)
    train_run = subflow_runs(prefect, run.id)[-1]  # the completed train flow run
    iteration = next(r for r in subflow_runs(prefect, train_run.id) if r.name == "iter-000002")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            log_in(page, ui, password, tmp_path / "login-again.png")
            assert_rendered_run(page, ui, train_run, iteration, tmp_path)
        except Exception:
            page.screenshot(path=str(tmp_path / "ui-failure.png"))
            raise
        finally:
            browser.close()


def artifact_links(page: Any) -> list[str]:
    return page.evaluate("Array.from(document.querySelectorAll('a')).map(a => a.href)"
                         ".filter(h => h.includes('/artifacts/artifact/'))")


def assert_rendered_run(page: Any, ui: str, train_run: Any, iteration: Any, shots: Path) -> None:
    """The run's Artifacts tab lists its summary, progress and checkpoint links, not a table per
    iteration; the summary page shows its charts as decoded images (summary.png); the iteration's
    page holds its metrics table and the user's `brevity` stage among its task runs (iteration.png),
    and its episodes table shows the agent's turns (episodes.png)."""
    page.goto(f"{ui}/runs/flow-run/{train_run.id}", wait_until="networkidle")
    page.get_by_text("Artifacts", exact=True).first.click()
    page.get_by_text("summary").first.wait_for(timeout=30_000)
    links = sorted(set(artifact_links(page)))
    page.screenshot(path=str(shots / "run-artifacts.png"))
    assert 2 <= len(links) <= 5, links  # summary, progress, up to 3 checkpoint links
    assert page.get_by_text(f"{train_run.name}-metrics").count() == 0  # the tables are on the iterations' pages
    summary = next(link for link in links if page.goto(link, wait_until="networkidle") and
                   page.get_by_text("iterations trained").count())
    page.wait_for_function("Array.from(document.images).filter(i => i.src.startsWith('data:image/svg')"
                           " && i.naturalWidth > 0).length >= 4", timeout=30_000)
    charts = page.evaluate("Array.from(document.images).filter(i => i.src.startsWith('data:image/svg'))"
                           ".map(i => [i.alt, i.naturalWidth, i.getBoundingClientRect().height])")
    page.screenshot(path=str(shots / "summary.png"), full_page=True)
    titles = {alt for alt, width, height in charts if width > 0 and height > 100}
    assert {"train reward", "response length", "entropy", "step time (s)"} <= titles, (summary, charts)
    page.goto(f"{ui}/runs/flow-run/{iteration.id}", wait_until="networkidle")
    page.get_by_text("Task Runs", exact=True).first.click()
    page.get_by_text("brevity").first.wait_for(timeout=30_000)
    page.screenshot(path=str(shots / "iteration.png"))
    page.get_by_text("Artifacts", exact=True).first.click()
    page.get_by_text(f"{train_run.name}-metrics").first.wait_for(timeout=30_000)
    page.get_by_text(f"{train_run.name}-episodes").first.wait_for(timeout=30_000)
    links = sorted(set(artifact_links(page)))
    assert len(links) == 2, links  # the metrics and the episodes
    episodes = next(link for link in links if page.goto(link, wait_until="networkidle") and
                    page.get_by_text(f"{train_run.name}: the episodes of iteration 2").count())
    page.get_by_text("assistant: ").first.wait_for(timeout=30_000)  # the table's turns, as rendered
    assert page.get_by_role("columnheader", name="observation_tokens").count() == 1, episodes
    page.screenshot(path=str(shots / "episodes.png"), full_page=True)
