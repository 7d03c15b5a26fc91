"""Line charts of a run's metrics as small SVG images, for the summary artifact in the Prefect UI.

The Prefect UI renders markdown artifacts (no scripts, no plotting library): each chart is an SVG
embedded as a `data:` URI image, so it needs no server to host it and no package beyond the standard
library. `chart_markdown(history)` gives the summary's charts section.
"""

from __future__ import annotations

import base64
import math
from typing import Any
from xml.sax.saxutils import escape

# (title, metric key, number format) of the charts in the summary, in order.
CHARTS = (
    ("train reward", "critic/score/mean", "{:.3f}"),
    ("validation score", "val/score/mean", "{:.3f}"),
    ("SFT loss", "actor/sft_loss", "{:.4f}"),
    ("validation loss (SFT)", "val/loss", "{:.4f}"),
    ("DPO loss", "actor/dpo_loss", "{:.4f}"),
    ("reverse KL to the teacher", "distill/reverse_kl", "{:.4f}"),
    ("preference accuracy (validation)", "val/preference_accuracy", "{:.3f}"),
    ("response length", "response_length/mean", "{:.1f}"),
    ("KL to the reference", "actor/kl", "{:.4f}"),
    ("entropy", "actor/entropy", "{:.3f}"),
    ("step time (s)", "timing_s/step", "{:.2f}"),
)
KL_KEYS = ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")  # the first present is charted
WIDTH, HEIGHT, PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 460, 180, 58, 14, 30, 30
_LINE = "#2f6fde"


def series(history: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(iteration, value) of `key` over the metrics lines that have it; "actor/kl" is the first KL metric
    the run logs (the loss, the in-reward penalty, or the ratio's KL)."""
    if key == "actor/kl":
        key = next((k for k in KL_KEYS if any(k in m for m in history)), KL_KEYS[0])
    points = []
    for m in history:
        value = m.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and "iteration" in m:
            points.append((float(m["iteration"]), float(value)))
    return points


def line_chart_svg(title: str, points: list[tuple[float, float]], fmt: str = "{:.3g}") -> str:
    """An SVG line chart of `points` (x ascending) with its title, y range and x range labelled."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 == y0:
        y0, y1 = y0 - 0.5 * (abs(y0) or 1.0), y1 + 0.5 * (abs(y1) or 1.0)
    plot_w, plot_h = WIDTH - PAD_LEFT - PAD_RIGHT, HEIGHT - PAD_TOP - PAD_BOTTOM

    def at(x: float, y: float) -> str:
        px = PAD_LEFT + (plot_w * (x - x0) / (x1 - x0) if x1 > x0 else plot_w / 2)
        py = PAD_TOP + plot_h * (1 - (y - y0) / (y1 - y0))
        return f"{px:.1f},{py:.1f}"

    path = " ".join(at(x, y) for x, y in points)
    marks = "".join(f'<circle cx="{at(x, y).split(",")[0]}" cy="{at(x, y).split(",")[1]}" r="2.5" fill="{_LINE}"/>'
                    for x, y in points) if len(points) <= 40 else ""
    text = 'font-family="sans-serif" font-size="11" fill="#555"'
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}">'
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>'
        f'<text x="{PAD_LEFT}" y="18" font-family="sans-serif" font-size="13" font-weight="bold" fill="#222">'
        f'{escape(title)}</text>'
        f'<line x1="{PAD_LEFT}" y1="{PAD_TOP}" x2="{PAD_LEFT}" y2="{PAD_TOP + plot_h}" stroke="#bbb"/>'
        f'<line x1="{PAD_LEFT}" y1="{PAD_TOP + plot_h}" x2="{PAD_LEFT + plot_w}" y2="{PAD_TOP + plot_h}" stroke="#bbb"/>'
        f'<text x="{PAD_LEFT - 6}" y="{PAD_TOP + 4}" text-anchor="end" {text}>{escape(fmt.format(y1))}</text>'
        f'<text x="{PAD_LEFT - 6}" y="{PAD_TOP + plot_h}" text-anchor="end" {text}>{escape(fmt.format(y0))}</text>'
        f'<text x="{PAD_LEFT}" y="{HEIGHT - 10}" {text}>iter {x0:g}</text>'
        f'<text x="{PAD_LEFT + plot_w}" y="{HEIGHT - 10}" text-anchor="end" {text}>iter {x1:g}</text>'
        f'<polyline points="{path}" fill="none" stroke="{_LINE}" stroke-width="2"/>{marks}</svg>'
    )


def data_uri(svg: str) -> str:
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()


def chart_markdown(history: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: one image per chart that has at least one point."""
    lines = []
    for title, key, fmt in CHARTS:
        points = series(history, key)
        if points:
            lines.append(f"![{title}]({data_uri(line_chart_svg(title, points, fmt))})")
    return lines
