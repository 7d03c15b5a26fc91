"""The reasoning_gym reward: the last <answer>...</answer> scored by the task's own verifier, plus
reward.format_weight x the format component; refused where nothing has a format component."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from engine.config import RewardConfig
from engine.data.reasoning_gym import make_reasoning_gym_rows
from engine.errors import ConfigError, RewardError
from engine.rewards import score_batch
from engine.rewards.reasoning_gym import extract_answer
from engine.rewards.registry import check_format_weight
from flows.config import load_config


def rows(task: str, **options: Any) -> list[dict[str, Any]]:
    return make_reasoning_gym_rows(task, n=8, val_n=1, seed=11, options=options)[0]


def score(row: dict[str, Any], responses: list[str], **reward: Any) -> tuple[list[float], list[str]]:
    batch = score_batch([row["data_source"]] * len(responses), responses,
                        [row["reward_model"]["ground_truth"]] * len(responses), [row["extra_info"]] * len(responses),
                        cfg=RewardConfig(**reward))
    return batch.scores, [info["status"] for info in batch.info]


@pytest.fixture(scope="module")
def chain_sum_row() -> dict[str, Any]:
    """A chain_sum row whose answer is a positive number of 3 digits or more (room for "+0", ",")."""
    return next(r for r in rows("chain_sum", min_terms=2, max_terms=2, min_digits=3, max_digits=3)
                if int(r["reward_model"]["ground_truth"]) >= 100)


def test_the_answer_is_the_last_tag() -> None:
    assert extract_answer("so <answer> 12 </answer>") == "12"
    assert extract_answer("<answer>3</answer> no, <answer>\n4\n</answer> done") == "4"
    assert extract_answer("the answer is 12") is None
    assert extract_answer("<answer>  </answer>") is None  # empty: no answer
    assert extract_answer("<answer>12") is None  # unclosed


@pytest.mark.effect_of("reward.format_weight")
def test_right_wrong_and_no_answer_with_and_without_the_format_weight(chain_sum_row: dict[str, Any]) -> None:
    truth = chain_sum_row["reward_model"]["ground_truth"]
    responses = [f"Adding up: <answer>{truth}</answer>", f"<answer>{int(truth) + 1}</answer>", f"It is {truth}.",
                 f"<answer>{int(truth) + 1}</answer> wait, <answer>{truth}</answer>",
                 f"<answer>{truth}</answer> wait, <answer>{int(truth) + 1}</answer>"]
    statuses = ["right", "wrong", "no_answer", "right", "wrong"]
    assert score(chain_sum_row, responses) == ([1.0, 0.0, 0.0, 1.0, 0.0], statuses)
    # reward.format_weight=0.25: a quarter more wherever the tag is there, right or wrong
    assert score(chain_sum_row, responses, format_weight=0.25) == ([1.25, 0.25, 0.0, 1.25, 0.25], statuses)
    assert score(chain_sum_row, responses, format_weight=-1.0)[0] == [0.0, -1.0, 0.0, 0.0, -1.0]


def test_the_tasks_own_verifier_scores(chain_sum_row: dict[str, Any]) -> None:
    """chain_sum's verifier takes a sign, leading zeros, thousands commas and decimals; basic_arithmetic's
    (the library's default) gives len(truth)/len(answer) to an answer that holds the truth: neither is
    string equality, so a right score here is the verifier's."""
    truth = chain_sum_row["reward_model"]["ground_truth"]
    with_commas = f"{int(truth):,}"
    assert score(chain_sum_row, [f"<answer>+0{truth}.00</answer>", f"<answer>{with_commas}</answer>"]) == \
        ([1.0, 1.0], ["right", "right"])
    basic = rows("basic_arithmetic", min_terms=2, max_terms=2, max_digits=2)[0]
    answer = basic["reward_model"]["ground_truth"]
    longer = f"x = {answer}"
    assert score(basic, [f"<answer>{longer}</answer>"]) == ([len(answer) / len(longer)], ["wrong"])


def test_a_verifier_that_raises_on_the_answer_scores_0_as_an_error() -> None:
    """boxnet's verifier parses the answer as JSON actions and raises (TypeError) on `null`: the model's text,
    so 0 with status error, counted; the format component still counts the tag."""
    row = rows("boxnet")[0]
    assert score(row, ["<answer>null</answer>"], format_weight=0.5) == ([0.5], ["error"])


def test_a_row_without_its_entry_is_a_broken_dataset(chain_sum_row: dict[str, Any]) -> None:
    broken = {**chain_sum_row, "extra_info": {k: v for k, v in chain_sum_row["extra_info"].items() if k != "entry"}}
    with pytest.raises(RewardError, match=r"reward 'reasoning_gym' for data_source 'reasoning_gym/chain_sum' "
                                          r"raised at row 0: KeyError: 'entry'"):
        score(broken, ["<answer>1</answer>"])


def test_a_format_weight_that_would_change_nothing_is_refused() -> None:
    weighted = RewardConfig(format_weight=0.5)
    check_format_weight(weighted, ["rlflow/arith", "reasoning_gym/chain_sum"])  # one reward has it: taken
    check_format_weight(RewardConfig(), ["rlflow/arith"])  # 0 is taken anywhere
    with pytest.raises(ConfigError, match=r"^reward.format_weight=0.5 weighs a reward's format component, and the "
                                          r"data's rewards \(gsm8k, sort\) have none \(those of reasoning_gym/\* "
                                          r"have\): leave it at 0$"):
        check_format_weight(weighted, ["rlflow/arith", "rlflow/sort"])
    with pytest.raises(ConfigError, match=r"^reward.format_weight=0.5 weighs a registered reward's format component, "
                                          r"and reward.function=.* replaces the registry: leave it at 0$"):
        check_format_weight(RewardConfig(format_weight=0.5, function="engine.rewards.rules:exact_match_score"),
                            ["reasoning_gym/chain_sum"])
    with pytest.raises(ConfigError, match=r"reward.format_weight.*with rollout.env the environment gives the reward"):
        load_config(None, ["reward.format_weight=0.5", "rollout.multi_turn.enable=true",
                           "rollout.env=engine.rollout.builtin_envs:GuessNumber"])


def test_a_run_without_reasoning_gym_is_refused_before_it_starts(chain_sum_row: dict[str, Any],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`rlflow train` on reasoning-gym rows where the package is missing: the reward check before the run
    (flows.plan.check_reward) fails in one line naming the extra."""
    from engine.data.prompts import PromptDataset, PromptRow
    from engine.rewards.reasoning_gym import task_dataset
    from flows.plan import check_reward

    row = PromptRow(chain_sum_row["prompt"], chain_sum_row["data_source"], chain_sum_row["reward_model"]["ground_truth"],
                    chain_sum_row["extra_info"], origin="train.parquet:0")
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    task_dataset.cache_clear()  # built by the tests above in this process
    with pytest.raises(RewardError) as refused:
        check_reward(PromptDataset([row], ["train.parquet"]), RewardConfig())
    task_dataset.cache_clear()
    line = str(refused.value)
    assert "\n" not in line and line.startswith("reward check before the run, an empty response on train rows "
                                                "train.parquet:0: reward 'reasoning_gym' for data_source "
                                                "'reasoning_gym/chain_sum' raised at row 0: DataError: reasoning-gym "
                                                "tasks need the reasoning-gym package, which is not installed"), line
    assert line.endswith("install it with: pip install -e '.[reasoning-gym]' (reasoning-gym==0.1.25)"), line


def test_the_share_of_each_status_is_a_metric(chain_sum_row: dict[str, Any]) -> None:
    """The scoring stages count the statuses the reward reports (`reward/status/right`, `val/status/...`):
    with reward.format_weight the score's mean is not the share right, the status is."""
    import types

    import torch

    from engine.batch import Batch
    from tasks.stages import _score, status_shares

    truth = chain_sum_row["reward_model"]["ground_truth"]
    texts = [f"<answer>{truth}</answer>", f"<answer>{int(truth) + 1}</answer>", "no tag", f"<answer>{truth}</answer>"]
    batch = Batch({"score_slot": torch.zeros(4)},
                  {"data_source": [chain_sum_row["data_source"]] * 4, "response_text": texts,
                   "ground_truth": [truth] * 4, "extra_info": [chain_sum_row["extra_info"]] * 4})
    ctx = types.SimpleNamespace(plan=types.SimpleNamespace(reward=RewardConfig(format_weight=0.5)))
    counts: dict[str, int] = {}
    scores, chunks = _score(ctx, batch, statuses=counts)  # type: ignore[arg-type]
    assert scores.tolist() == [1.5, 0.5, 0.0, 1.5] and chunks == 1
    assert status_shares(counts, len(batch), "val") == {"val/status/no_answer": 0.25, "val/status/right": 0.5,
                                                       "val/status/wrong": 0.25}
