"""Environments (rollout.env, engine/rollout/envs.py) through the multi-turn loop with a scripted policy,
the tiny model's tokenizer and real sandbox children: the conversation is the chat template's, the
observations are holes in the response mask, each step's reward sits at its turn's last token, each
episode has a process of its own, and every way an environment goes wrong ends only its own episode,
within its deadline."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from engine.batch import Batch
from engine.config import RolloutConfig
from engine.errors import ConfigError
from engine.rollout.base import RolloutOutput
from engine.rollout.envs import EnvEpisodes, EnvLimits, check_env
from engine.rollout.multi_turn import run_episodes

ENVS = Path(__file__).resolve().parents[1] / "pipeline" / "envs.py"
GUESS = "engine.rollout.builtin_envs:GuessNumber"
LIMITS = EnvLimits(step_timeout_s=5.0, memory_mb=512)


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201
    from engine.demo.tiny import build_tokenizer

    return build_tokenizer()


class _Player:
    """A rollout backend whose turn, for each row, is `play(the row's text so far)` and eos."""

    def __init__(self, tok, play) -> None:  # noqa: ANN001
        self.tok, self.play = tok, play
        self.stop_ids = [tok.eos_token_id]

    def generate(self, input_ids, attention_mask, params, seed):  # noqa: ANN001, ANN201
        rows, width = input_ids.shape[0], params.max_new_tokens
        responses = torch.full((rows, width), self.tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for r in range(rows):
            context = self.tok.decode(input_ids[r][attention_mask[r].bool()].tolist())
            turn = (self.tok(self.play(context), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id])
            turn = turn[:width]
            responses[r, :len(turn)] = torch.tensor(turn)
            mask[r, :len(turn)] = 1
        return RolloutOutput(responses, mask, -0.5 * mask.float())


def _bisect(context: str) -> str:
    """Binary search over 1-16 from the hints so far."""
    low, high = 1, int(re.search(r"guess 1-(\d+)", context).group(1))
    for guess, hint in re.findall(r"<\|assistant\|>(\d+)</s><\|user\|>(higher|lower)", context):
        low, high = (int(guess) + 1, high) if hint == "higher" else (low, int(guess) - 1)
    return str((low + high) // 2)


def _prompts(truths: list[str]) -> Batch:
    rows = len(truths)
    return Batch({"input_ids": torch.full((rows, 2), 5), "attention_mask": torch.ones((rows, 2), dtype=torch.long)},
                 {"data_source": ["t"] * rows, "ground_truth": truths, "extra_info": [None] * rows})


def _run(tok, ref: str, truths: list[str], play=_bisect, *, max_turns: int = 5, max_new_tokens: int = 96,  # noqa: ANN001
         limits: EnvLimits = LIMITS, error_reward: float = 0.0) -> Batch:
    cfg = RolloutConfig(max_new_tokens=max_new_tokens, multi_turn={"enable": True, "max_turns": max_turns},
                        env=ref)
    episodes = EnvEpisodes(tok, cfg.env, limits, width=24, error_reward=error_reward, seeds=list(range(len(truths))),
                           readable=[str(ENVS)])
    return run_episodes(_Player(tok, play), tok, episodes, _prompts(truths), cfg, seed=0, iteration=1, rank=0,
                        do_sample=True, version=0, stage="generate_rollouts")


def _conversation(tok, out: Batch, r: int) -> str:  # noqa: ANN001
    p = out["prompt_ids"].shape[1]
    real = out["attention_mask"][r].bool()
    return tok.decode(out["input_ids"][r][real].tolist()) if p else ""


def test_a_guessing_episode_is_the_templates_conversation_with_the_reward_at_the_right_guess(tok) -> None:  # noqa: ANN001
    out = _run(tok, GUESS, ["11", "8", "16"])
    expected_guesses = {"11": ["8", "12", "10", "11"], "8": ["8"], "16": ["8", "12", "14", "15", "16"]}
    for r, truth in enumerate(["11", "8", "16"]):
        guesses = expected_guesses[truth]
        turns = json.loads(out["turns"][r])
        assert [t["content"] for t in turns if t["role"] == "assistant"] == guesses
        # the whole row is the chat template's conversation: init's prompt, the turns, the hints
        messages = [{"role": "user", "content": "guess 1-16"}]
        for i, g in enumerate(guesses):
            messages.append({"role": "assistant", "content": g})
            if i + 1 < len(guesses):
                messages.append({"role": "user", "content": "higher" if int(g) < int(truth) else "lower"})
        assert _conversation(tok, out, r) == tok.apply_chat_template(messages, tokenize=False)
        # the hints are holes: no loss, no behaviour log-prob; the model's tokens are trained
        p = out["prompt_ids"].shape[1]
        real, trained = out["attention_mask"][r, p:].bool(), out["response_mask"][r].bool()
        holes = real & ~trained
        hints = "".join(f"<|user|>{m['content']}<|assistant|>" for m in messages[2::2])
        assert tok.decode(out["responses"][r][holes].tolist()) == hints
        assert bool((out["rollout_logp"][r][holes] == 0).all())
        # reward 1 at the last token (eos) of the right guess, 0 elsewhere
        last = int(trained.nonzero()[-1])
        assert out["env_token_rewards"][r, last] == 1.0 and float(out["env_token_rewards"][r].sum()) == 1.0
        assert float(out["env_reward"][r]) == 1.0 and int(out["env_steps"][r]) == len(guesses)
        assert int(out["env_errors"][r]) == 0 and out["env_error"][r] == ""
        assert json.loads(out["env_prompt"][r]) == messages[:1]
        assert turns[-1 if len(guesses) == 1 else -1]["reward"] == 1.0 and turns[-1]["done"] is True


def test_out_of_turns_the_last_step_still_scores_and_its_observation_is_not_read(tok) -> None:  # noqa: ANN001
    out = _run(tok, GUESS, ["16"], max_turns=2)
    turns = json.loads(out["turns"][0])
    assert [t["role"] for t in turns] == ["assistant", "user", "assistant"]
    assert float(out["env_reward"][0]) == 0.0 and int(out["env_steps"][0]) == 2
    assert _conversation(tok, out, 0).endswith("<|assistant|>12</s>")


def test_each_episode_has_its_own_process_and_state(tok) -> None:  # noqa: ANN001
    """Counter's observations say how many instances their process built and whether another episode's
    file in /tmp is there: 1 and no, for every episode; its prints never reach the trainer."""
    out = _run(tok, f"{ENVS}:Counter", ["a", "b", "c"], play=lambda context: "ok", max_turns=4)
    for r, truth in enumerate("abc"):
        observations = [t["content"] for t in json.loads(out["turns"][r]) if t["role"] == "user"]
        assert observations == ["step 1 of 1 [ok]", "step 2 of 1 [ok]"]  # the third step is done
        assert json.loads(out["env_prompt"][r]) == [{"role": "user", "content": f"count {truth}"}]
        assert float(out["env_reward"][r]) == 0.75 and int(out["env_steps"][r]) == 3


@pytest.mark.parametrize(("name", "why"), [
    ("HangsOnSecondStep", r"HangsOnSecondStep\.step ran over its 1 s \(rollout\.multi_turn\.env_step_timeout_s\)"),
    ("Raises", r"Raises\.step failed: ValueError: no such move"),
    ("WrongShape", r"WrongShape\.step returned 'higher', not \(observation messages, reward, done, info\)"),
    ("Exits", r"Exits\.step: the environment's process ended \(exit code 3\)"),
    ("Huge", r"Huge\.step failed: out of memory \(rollout\.multi_turn\.env_memory_mb\)"),
])
def test_an_environment_that_goes_wrong_ends_its_own_episode_only(tok, name: str, why: str) -> None:  # noqa: ANN001
    """Row 0's episode goes wrong (its ground truth is "bad"), row 1's, of the same class in the same batch,
    plays on to the end."""
    limits = EnvLimits(step_timeout_s=1.0, memory_mb=512)
    start = time.monotonic()
    out = _run(tok, f"{ENVS}:{name}", ["bad", "good"], play=lambda context: "ok", max_turns=4, limits=limits,
               error_reward=-1.0)
    assert time.monotonic() - start < 20  # the hang is cut at its deadline, not waited for
    assert re.fullmatch(why, out["env_error"][0]), out["env_error"][0]
    assert out["env_errors"].tolist() == [1, 0]
    assert out["env_reward"].tolist() == [-1.0, 0.75]  # the configured reward, at the last generated token
    trained = out["response_mask"][0].nonzero()
    assert out["env_token_rewards"][0, int(trained[-1])] == -1.0
    assert float(out["env_token_rewards"][0].abs().sum()) == 1.0
    turns = json.loads(out["turns"][0])
    assert turns[-1]["role"] == "assistant" and turns[-1]["error"] == out["env_error"][0]
    assert out["env_steps"].tolist() == [1 if name == "HangsOnSecondStep" else 0, 3]
    assert [t["content"] for t in json.loads(out["turns"][1]) if t["role"] == "user"] == \
        ["step 1 of 1 [ok]", "step 2 of 1 [ok]"]


def test_the_rollouts_deadline_ends_the_episodes_still_waiting(tok) -> None:  # noqa: ANN001
    """Steps of 0.6 s each, answered in parallel; a rollout deadline of 1 s: every episode's first step is
    answered, its second is not waited for."""
    limits = EnvLimits(step_timeout_s=5.0, memory_mb=512, rollout_timeout_s=1.0)
    start = time.monotonic()
    out = _run(tok, f"{ENVS}:Slow", ["a", "b", "c"], play=lambda context: "ok", max_turns=4, limits=limits)
    assert time.monotonic() - start < 8
    assert out["env_steps"].tolist() == [1, 1, 1] and out["env_errors"].tolist() == [1, 1, 1]
    assert set(out["env_error"]) == {"Slow.step: the rollout's episodes ran over their 1 s "
                                     "(rollout.multi_turn.env_rollout_timeout_s)"}


def test_a_hung_init_ends_the_episode_and_the_model_answers_the_rows_prompt(tok) -> None:  # noqa: ANN001
    limits = EnvLimits(step_timeout_s=1.0, memory_mb=512)
    start = time.monotonic()
    out = _run(tok, f"{ENVS}:HangsInInit", ["a"], play=lambda context: "ok", limits=limits)
    assert time.monotonic() - start < 40
    assert out["env_error"][0] == "HangsInInit.init ran over its 1 s (rollout.multi_turn.env_step_timeout_s)"
    assert [t["role"] for t in json.loads(out["turns"][0])] == ["assistant"]
    assert int(out["env_steps"][0]) == 0 and float(out["env_reward"][0]) == 0.0


@pytest.mark.parametrize(("ref", "why"), [
    (f"{ENVS}:NoStep", "has no method step"),
    (f"{ENVS}:NeedsArguments", "cannot be built without arguments"),
    (f"{ENVS}:not_a_class", "is not a class"),
])
def test_a_class_without_the_protocol_is_refused_in_one_line(ref: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_env(ref, LIMITS, [str(ENVS)])
    assert why in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith(f"rollout.env: {ref} ")
    check_env(GUESS, LIMITS)  # the builtin one passes
