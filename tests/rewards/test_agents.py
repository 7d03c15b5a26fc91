"""Black-box agents (rollout.agent, engine/rollout/agents.py) through the multi-turn loop, with real
sandbox children running agents written against the openai client: an agent that plays the guessing game
gives the environment's rows exactly; the rows hold the tokens and log-probs the engine sampled, never a
re-tokenisation of the text the agent saw; each way an agent goes wrong ends its own episode, within its
deadline; an agent that is not one is refused in one line."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from engine.config import RolloutConfig
from engine.errors import ConfigError
from engine.rollout.agents import AgentEpisodes, AgentSession, Sampling, check_agent
from engine.rollout.envs import EnvEpisodes, EnvLimits
from engine.rollout.multi_turn import run_episodes
from tests.rewards.test_envs import _bisect, _Player, _prompts

AGENTS = Path(__file__).resolve().parents[1] / "pipeline" / "agents.py"
LIMITS = EnvLimits(step_timeout_s=5.0, memory_mb=512)
TENSORS = ("input_ids", "attention_mask", "prompt_ids", "responses", "response_mask", "rollout_logp",
           "env_token_rewards", "env_reward", "env_errors", "env_steps")


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201
    from engine.demo.tiny import build_tokenizer

    return build_tokenizer()


def _run(tok, ref: str, truths: list[str], rollout=None, *, play=_bisect, max_turns: int = 5,  # noqa: ANN001
         max_new_tokens: int = 96, limits: EnvLimits = LIMITS, error_reward: float = 0.0, env: bool = False):
    cfg = RolloutConfig(max_new_tokens=max_new_tokens, multi_turn={"enable": True, "max_turns": max_turns},
                        **({"env": ref} if env else {"agent": ref}))
    seeds = list(range(len(truths)))
    episodes = (EnvEpisodes(tok, ref, limits, width=24, error_reward=error_reward, seeds=seeds) if env else
                AgentEpisodes(tok, ref, limits, width=24, error_reward=error_reward, seeds=seeds,
                              sampling=Sampling(cfg.temperature, cfg.top_p), readable=[str(AGENTS)]))
    return run_episodes(rollout or _Player(tok, play), tok, episodes, _prompts(truths), cfg, seed=0, iteration=1,
                        rank=0, do_sample=True, version=0, stage="generate_rollouts")


def _wanders(context: str) -> str:
    """Not a bisection: a guess from the length of the conversation so far, sometimes no number at all."""
    n = len(context)
    return "hm" if n % 5 == 0 else str(n % 16 + 1)


@pytest.mark.parametrize("play", [_bisect, _wanders])
def test_the_guessing_agent_gives_the_environments_rows_exactly(tok, play) -> None:  # noqa: ANN001
    """engine.rollout.builtin_agents:guess_number is GuessNumber written as an agent: the same prompts,
    turns, hints, rewards, steps, to the byte, out of turns as well as at the right guess."""
    truths = ["11", "8", "16", "3"]
    env = _run(tok, "engine.rollout.builtin_envs:GuessNumber", truths, play=play, max_turns=4, env=True)
    agent = _run(tok, "engine.rollout.builtin_agents:guess_number", truths, play=play, max_turns=4)
    for key in TENSORS:
        assert torch.equal(env[key], agent[key]), key
    assert agent["env_error"] == [""] * 4 and agent["env_prompt"] == env["env_prompt"]
    assert 0 < float(agent["env_reward"].sum()) < 4  # some rows guessed, some ran out of turns
    contents = [[t["content"] for t in json.loads(row)] for row in env["turns"]]
    assert [[t["content"] for t in json.loads(row)] for row in agent["turns"]] == contents


class _Spy:
    """The real HF engine, with every call's output kept."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.stop_ids, self.calls = inner, inner.stop_ids, []

    def generate(self, input_ids, attention_mask, params, seed):  # noqa: ANN001, ANN201
        out = self.inner.generate(input_ids, attention_mask, params, seed)
        self.calls.append((input_ids, attention_mask, out))
        return out


def test_rows_hold_the_engines_tokens_and_log_probs_not_a_retokenisation(tok) -> None:  # noqa: ANN001
    """An untrained tiny model samples freely (special tokens inside a turn too), so the text the agent
    reads would tokenise back to other ids. The row's trained tokens and behaviour log-probs are the
    engine's, call by call; what the agent was sent (its returned sum of log-probs) is the row's."""
    from engine.demo.tiny import build_model
    from engine.rollout.hf import HFRollout

    model = build_model(tok, seed=3)
    spy = _Spy(HFRollout(model, int(tok.pad_token_id), [int(tok.eos_token_id)]))
    truths = ["a", "b", "c", "d"]
    out = _run(tok, f"{AGENTS}:chatter", truths, spy, max_turns=3, max_new_tokens=64)
    assert out["env_error"] == [""] * 4 and out["env_steps"].tolist() == [3, 3, 3, 3]
    assert [call[0].shape[0] for call in spy.calls] == [4, 4, 4]  # a call a turn, every row in it
    differs = 0
    for r in range(len(truths)):
        turns = []
        for _, _, gen in spy.calls:
            keep = gen.response_mask[r].bool()  # up to its eos; the agent's max_tokens cuts it at 8
            turns.append((gen.responses[r][keep].tolist()[:8], gen.logp[r][keep].tolist()[:8]))
        trained = out["response_mask"][r].bool()
        assert out["responses"][r][trained].tolist() == [t for ids, _ in turns for t in ids]
        logps = out["rollout_logp"][r][trained].tolist()
        assert logps == [lp for _, lps in turns for lp in lps]
        sent = 0.0  # what the agent was sent, summed as it sums: the row's reward (float32)
        for _, lps in turns:
            sent += sum(lps)
        assert float(out["env_reward"][r]) == float(torch.tensor(sent, dtype=torch.float32))
        for ids, _ in turns:
            differs += tok(tok.decode(ids, skip_special_tokens=True), add_special_tokens=False)["input_ids"] != ids
    assert differs > 0  # a re-tokenisation of the text would have given other rows


@pytest.mark.parametrize(("fault", "why"), [
    ("hang", r"goes_wrong: its call 2 or its return ran over its 1 s \(rollout\.multi_turn\.env_step_timeout_s\)"),
    ("raise", r"goes_wrong failed: ValueError: no such move"),
    ("text", r"goes_wrong returned 'good', not a finite number \(the episode's reward\)"),
    ("rewrite", r"goes_wrong's call 2: it does not continue the conversation: .*"),
    ("temperature", r"goes_wrong's call 2: temperature=0\.3: the run samples with rollout\.temperature=1\.0 .*"),
    ("silent", r"goes_wrong returned without calling the endpoint \(client\.chat\.completions\.create\)"),
])
def test_an_agent_that_goes_wrong_ends_its_own_episode_only(tok, fault: str, why: str) -> None:  # noqa: ANN001
    limits = EnvLimits(step_timeout_s=1.0, memory_mb=512)
    start = time.monotonic()
    out = _run(tok, f"{AGENTS}:goes_wrong", [fault, "fine"], play=lambda context: "ok", max_turns=3, limits=limits,
               error_reward=-1.0)
    assert time.monotonic() - start < 30  # the hang is cut at its deadline, not waited for
    assert re.fullmatch(why, out["env_error"][0]), out["env_error"][0]
    assert out["env_errors"].tolist() == [1, 0] and out["env_error"][1] == ""
    assert out["env_reward"].tolist() == [-1.0, 0.5]
    trained = out["response_mask"][0].nonzero()
    assert out["env_token_rewards"][0, int(trained[-1])] == -1.0


def test_an_agent_that_never_calls_is_refused_in_one_line(tok) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError) as err:
        _run(tok, f"{AGENTS}:silent", ["a", "b"])
    assert str(err.value) == (f"rollout.agent: {AGENTS}:silent returned without calling the endpoint in every "
                              "episode: an agent's episode is its calls of client.chat.completions.create")


def test_the_endpoint_answers_only_its_own_episodes_key() -> None:
    import http.client
    import socket

    session = AgentSession(f"{AGENTS}:chatter", LIMITS, [str(AGENTS)])
    try:
        class Unix(http.client.HTTPConnection):
            def connect(self) -> None:
                self.sock = socket.socket(socket.AF_UNIX)
                self.sock.connect(session.socket_path)

        for key, status in (("not-its-key", 401), (session.key, 400)):
            conn = Unix("rlflow")
            conn.request("POST", "/v1/chat/completions", body=b"{", headers={"Authorization": f"Bearer {key}"})
            assert conn.getresponse().status == status
        assert Path(session.socket_path).parent.stat().st_mode & 0o077 == 0  # the folder is this user's alone
    finally:
        session.close()
    assert not Path(session.socket_path).exists()


@pytest.mark.parametrize(("ref", "why"), [
    (f"{AGENTS}:one_argument", "does not take (client, row)"),
    (f"{AGENTS}:not_a_function", "is not a function"),
])
def test_a_function_without_the_signature_is_refused_in_one_line(ref: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_agent(ref, LIMITS, [str(AGENTS)])
    assert why in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith(f"rollout.agent: {ref} ")
    check_agent("engine.rollout.builtin_agents:guess_number", LIMITS)  # the builtin one passes
