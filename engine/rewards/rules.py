"""Rule rewards on the text of a response: gsm8k-style `#### answer`, exact match, format, sort.

All have verl's row signature `(data_source, solution_str, ground_truth, extra_info=None) -> float`.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

# verl utils/reward_score/gsm8k.py (strict): the first "#### <number>"; commas and "$" are dropped.
# We also accept no or several spaces after "####".
_HASH_NUMBER = re.compile(r"####\s*(-?[0-9.,$]+)")
_HASH_TOKEN = re.compile(r"####\s*(\S+)")


def extract_hash_answer(text: str) -> str | None:
    """The number after the first `####`, without thousands commas or `$`; None when there is none."""
    match = _HASH_NUMBER.search(text)
    if match is None:
        return None
    answer = match.group(1).replace(",", "").replace("$", "")
    return answer or None


def same_number(answer: str, truth: str) -> bool:
    """Equal as decimal numbers ("72" == "72.0" == "72."), else equal as strings.

    verl compares the strings only; comparing values stops a right answer written "72.0" scoring 0.
    """
    try:
        return Decimal(answer.rstrip(".")) == Decimal(truth.replace(",", "").strip())
    except InvalidOperation:
        return answer == truth.strip()


def gsm8k_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the `#### answer` equals the ground truth, else 0.0 (verl gsm8k, format_score=0)."""
    answer = extract_hash_answer(solution_str)
    return 1.0 if answer is not None and same_number(answer, str(ground_truth)) else 0.0


def exact_match_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> float:
    """1.0 when the whole response, stripped of outer whitespace, is the ground truth."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def format_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the stripped response fully matches the regular expression given as ground truth.

    A bad pattern raises (re.error): that is a broken dataset, reported with its row, never a 0.
    """
    pattern = re.compile(str(ground_truth), re.DOTALL)
    return 1.0 if pattern.fullmatch(solution_str.strip()) else 0.0


def sort_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """Partial credit for `#### <sorted digits>`: the fraction of positions right, 1.0 only when exact.

    Positions are counted over the longer of answer and truth, so a missing or extra character costs.
    """
    match = _HASH_TOKEN.search(solution_str)
    if match is None:
        return 0.0
    answer: str = match.group(1)
    truth = str(ground_truth).strip()
    if not truth:
        raise ValueError("empty ground truth for the sort task")
    right = sum(a == t for a, t in zip(answer, truth))
    return right / max(len(answer), len(truth))
