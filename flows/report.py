"""Prefect artifacts of a run: a metrics table on each iteration's own flow run, a progress bar and a
markdown summary with charts (flows/charts.py) on the run's flow run."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from flows import charts
from infra.layout import artifact_key

KEY_METRICS = ("critic/score/mean", "val/score/mean", "actor/sft_loss", "val/loss", "actor/dpo_loss",
               "actor/rewards/accuracy", "val/preference_accuracy", "response_length/mean", "actor/pg_loss", "actor/entropy",
               "actor/ppo_kl", "actor/grad_norm", "timing_s/step", "perf/orchestration_s")


def iteration_table(run_id: str, iteration: int, metrics: dict[str, float]) -> None:
    """The iteration's metrics, created in the iteration's own flow run (one there, not one per iteration
    on the run's page)."""
    rows = [{"metric": k, "value": round(v, 6)} for k, v in sorted(metrics.items())]
    create_table_artifact(rows, key=artifact_key(run_id, "metrics"),
                          description=f"{run_id}: metrics of iteration {iteration}")


class Progress:
    """One progress artifact per flow run, moved every iteration."""

    def __init__(self, run_id: str, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.id: UUID | None = create_progress_artifact(  # type: ignore[assignment]
            0.0, key=artifact_key(run_id, "progress"), description=f"{run_id}: iterations {first}-{last}")

    def update(self, iteration: int) -> None:
        done = (iteration - self.first + 1) / max(1, self.last - self.first + 1)
        if self.id is not None:
            update_progress_artifact(self.id, round(100.0 * done, 1))


def summary(run_id: str, history: list[dict[str, Any]], checkpoints: list[tuple[int, str]],
            export_url: str | None, timeline_url: str | None = None) -> str:
    """Markdown: charts of reward, validation score, response length, KL, entropy and step time, the
    first and last values, the last metrics, the committed checkpoints."""
    trained = [m for m in history if m["iteration"] >= 1]
    reward = [m["critic/score/mean"] for m in trained if "critic/score/mean" in m]
    val = [(m["iteration"], m["val/score/mean"]) for m in history if "val/score/mean" in m]
    sft = [m["actor/sft_loss"] for m in trained if "actor/sft_loss" in m]
    val_loss = [(m["iteration"], m["val/loss"]) for m in history if "val/loss" in m]
    lines = [f"# {run_id}", "", f"{len(trained)} iterations trained.", "", *charts.chart_markdown(history), "",
             "| curve | first | last |", "|---|---|---|"]
    if reward:
        lines.append(f"| train reward | {reward[0]:.3f} | {reward[-1]:.3f} |")
    if val:
        lines.append(f"| validation score | {val[0][1]:.3f} (iter {val[0][0]}) | {val[-1][1]:.3f} (iter {val[-1][0]}) |")
    if sft:
        lines.append(f"| SFT loss | {sft[0]:.4f} | {sft[-1]:.4f} |")
    accuracy = [(m["iteration"], m["val/preference_accuracy"]) for m in history if "val/preference_accuracy" in m]
    if accuracy:
        lines.append(f"| preference accuracy (validation) | {accuracy[0][1]:.3f} (iter {accuracy[0][0]}) | "
                     f"{accuracy[-1][1]:.3f} (iter {accuracy[-1][0]}) |")
    if val_loss:
        lines.append(f"| validation loss | {val_loss[0][1]:.4f} (iter {val_loss[0][0]}) | {val_loss[-1][1]:.4f} "
                     f"(iter {val_loss[-1][0]}) |")
    if trained:
        lines += ["", "## Last iteration", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {trained[-1][k]:.4g} |" for k in KEY_METRICS if k in trained[-1]]
    lines += ["", "## Committed checkpoints", ""]
    lines += [f"- step {step}: `{url}`" for step, url in checkpoints] or ["- none"]
    if export_url:
        lines += ["", f"Hugging Face export: `{export_url}`"]
    if timeline_url:
        lines += ["", f"Timeline of every stage and rank (open in https://ui.perfetto.dev): `{timeline_url}`"]
    return "\n".join(lines) + "\n"


def publish_summary(run_id: str, markdown: str, checkpoints: list[tuple[int, str]],
                    timeline_url: str | None = None) -> None:
    create_markdown_artifact(markdown, key=artifact_key(run_id, "summary"), description=f"{run_id}: summary")
    if timeline_url:
        create_link_artifact(timeline_url, link_text="timeline (Chrome/Perfetto trace)",
                             key=artifact_key(run_id, "timeline"))
    for step, url in checkpoints[-3:]:
        create_link_artifact(url, link_text=f"checkpoint step {step}", key=artifact_key(run_id, f"ckpt-{step}"))
