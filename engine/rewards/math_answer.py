"""MATH-style rewards: the answer in the last `\\boxed{...}`, normalised, compared with the ground truth.

The steps follow the Hendrycks MATH normaliser that verl uses (verl utils/reward_score/math.py, from
lm-evaluation-harness hendrycks_math): drop \\left/\\right, spacing commands, degrees, dollars, units in
a trailing \\text{...}, percent signs; write \\frac12 and 1/2 as \\frac{1}{2}; drop spaces. On top, two
numbers are equal when their values are (0.5 == \\frac{1}{2} == 1/2, 5.0 == 5, 1,000 == 1000).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`); None when there is none."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(cmd for cmd in _BOX_COMMANDS if text.startswith(cmd, start))
    after = text[start + len(command) :]
    if not after.startswith("{"):  # "\boxed 5$": up to a dollar sign or the end
        return after.strip().split("$")[0].strip() or None
    depth = 0
    for i, char in enumerate(after):
        depth += char == "{"
        depth -= char == "}"
        if depth == 0:
            return after[1:i]
    return None  # unbalanced braces: no answer


def strip_answer(answer: str) -> str:
    """A normal form of a LaTeX answer, so that equal answers written differently compare equal."""
    s = answer.strip().replace("\n", "")
    s = s.rstrip(".")
    for spacing in ("\\!", "\\,", "\\;", "\\:", "\\ "):
        s = s.replace(spacing, "")
    s = s.replace("\\\\", "\\").replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = _drop_trailing_text_unit(s)
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{(.*?)\}", r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if s.count("=") == 1 and len(s.split("=")[0].strip()) <= 2:  # "x = 5", "k=3": the value only
        s = s.split("=")[1]
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators, not a tuple like (1,2)
        s = s.replace(",", "")
    s = re.sub(r"(\d)\.0+(?!\d)", r"\1", s)  # 5.0 -> 5, 2.000 -> 2
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    return s


def _drop_trailing_text_unit(s: str) -> str:
    # "5\text{ cm}" -> "5": a trailing \text{...} is a unit when something is left in front of it.
    stripped = re.sub(r"\\(?:text|mbox)\{[^{}]*\}$", "", s).strip()
    return stripped if stripped else s


def _fix_fracs(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{72} -> \\frac{1}{72}, \\frac{a}b -> \\frac{a}{b}."""
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\w)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac(\{[^{}]*\})(\w)", r"\\frac\1{\2}", s)
    return s


def as_fraction(s: str) -> Fraction | None:
    """The value of a normalised number: an integer, a decimal, or -\\frac{a}{b} with integer a, b."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(\d+)\}", s)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?\d+(\.\d+)?", s):
            return Fraction(s)
    except ZeroDivisionError:
        return None
    return None


def is_equiv(answer: str, truth: str) -> bool:
    """Equal after normalisation, or equal in value."""
    a, t = strip_answer(answer), strip_answer(truth)
    if a == t:
        return True
    va, vt = as_fraction(a), as_fraction(t)
    return va is not None and va == vt


def math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the last boxed answer equals the ground truth (itself boxed or plain), else 0.0."""
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth  # some datasets keep the whole "\boxed{..}" as ground truth
    return 1.0 if is_equiv(answer, truth) else 0.0
