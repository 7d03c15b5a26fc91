"""Multi-turn rollouts: the model's turn, the other side's answer, the model's next turn, up to
rollout.multi_turn.max_turns. The other side (`Episodes`) is tools (`ToolEpisodes`) or an environment
(rollout.env: engine.rollout.envs.EnvEpisodes); `run_episodes` is the one loop both go through.

Each turn generates for the rows still going, from their prompt plus everything so far. With tools, a
turn that ends with a tool call (rollout.multi_turn.format; hermes' turn is cut right after </tool_call>,
llama3_json's ends at the model's end-of-turn token) has its call run in the sandbox (engine.rollout.tools),
and the observation is appended as the model's chat template writes a tool message
(engine.rollout.tools.observation_renderer); a turn without a call, or the last turn, ends the row. With an
environment, every turn goes to its step, whose observation messages follow as the chat template writes
them, until it says done or the turns run out. The row's response is all of it, turns and observations, in
one token sequence of at most rollout.max_new_tokens:

    responses      [B, T]  generated and observation tokens, pad after the end
    response_mask  [B, T]  1 on generated tokens only: observations are holes (no loss, no KL; GAE
                           carries values through them), padding 0
    attention_mask [B, P+T] 1 on every real token, observations included (the model reads them)
    rollout_logp   [B, T]  the behaviour log-probs of generated tokens, 0 elsewhere

and the column `turns` (JSON: [{"role": "assistant" | "tool" | ..., "content": ...}, ...] per row; an
observation's "text" is how the model read it, in its wrapping, cut at the length limit; an environment's
step adds "reward", "done", "info" or "error" to the turn it answered). Tools add the tensors
`tool_calls`, `tool_errors` [B] (calls made, and calls whose observation is an error); an environment
adds the columns of engine.rollout.envs.EnvEpisodes.

Seeds: each turn's sampling seed is derived from (run seed, iteration, stage, turn, micro-batch, rank), so a
replayed rollout makes the same turns (given deterministic tools).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from engine.batch import Batch
from engine.config import RolloutConfig
from engine.rewards.types import SandboxLimits
from engine.rollout.base import SamplingParams
from engine.rollout.tools import (
    CALL_END,
    ToolCall,
    ToolSpec,
    call_tools,
    observation_renderer,
    parse_tool_call,
)
from engine.seeds import derive_seed


@dataclass
class Reply:
    """The other side's answer to one assistant turn: `text` the model reads next (None: the episode ends
    at this turn), the records it adds to the row's `turns`, the step's reward."""

    text: str | None
    records: list[dict[str, Any]] = field(default_factory=list)
    reward: float = 0.0
    step: dict[str, Any] = field(default_factory=dict)  # what the turn's own record gains (reward, info, error)


class Episodes(Protocol):
    """The other side of a batch of episodes: tools (`ToolEpisodes`) or an environment
    (engine.rollout.env_episodes.EnvEpisodes)."""

    def prompts(self, prompts: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' prompt tokens and attention mask [B, P], left padded (a width every rank shares)."""
        ...

    def cut(self, row: int, ids: list[int]) -> int | None:
        """Where row `row`'s turn of generated tokens ends early (a tool call's closing text, an agent's
        max_tokens), or None."""
        ...

    def reply(self, turn: int, rows: list[int], ids: list[list[int]], ends: list[str], room: list[bool],
              logps: list[list[float]]) -> list[Reply]:
        """The answers to the rows' turns. `ids`: each turn's tokens, `logps` their behaviour log-probs;
        `ends`: the stop token the turn ended with, as text ("" if cut or cut off); `room`: whether the row
        can go on (turns and tokens left)."""
        ...

    def columns(self, rows: int, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
        """The tensors and columns the episodes add to the batch (`tensors` holds the loop's own)."""
        ...

    def close(self) -> None:
        """Let go of what the episodes hold (an environment's processes); called however the loop ends."""
        ...


def generate_multi_turn(rollout: Any, tokenizer: Any, tools: dict[str, tuple[str, ToolSpec]], prompts: Batch,
                        cfg: RolloutConfig, *, seed: int, iteration: int, rank: int, do_sample: bool, version: int,
                        stage: str, isolation: Literal["bwrap", "none"] = "bwrap") -> Batch:
    """Tool episodes (rollout.multi_turn.tools): see the module's docstring."""
    episodes = ToolEpisodes(tokenizer, tools, cfg, isolation)
    return run_episodes(rollout, tokenizer, episodes, prompts, cfg, seed=seed, iteration=iteration, rank=rank,
                        do_sample=do_sample, version=version, stage=stage)


def run_episodes(rollout: Any, tokenizer: Any, episodes: Episodes, prompts: Batch, cfg: RolloutConfig, *,
                 seed: int, iteration: int, rank: int, do_sample: bool, version: int, stage: str) -> Batch:
    """Turns of the model and answers of `episodes`, up to rollout.multi_turn.max_turns, in one token
    sequence a row of at most rollout.max_new_tokens (the module's docstring has the columns)."""
    limit, pad = cfg.max_new_tokens, int(tokenizer.pad_token_id)
    rows = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    trained: list[list[int]] = [[] for _ in range(rows)]
    logps: list[list[float]] = [[] for _ in range(rows)]
    rewards: list[list[float]] = [[] for _ in range(rows)]
    turns: list[list[dict[str, Any]]] = [[] for _ in range(rows)]
    going = list(range(rows))
    try:
        prompt_ids, prompt_mask = episodes.prompts(prompts)
        prompt_rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        _turns(rollout, tokenizer, episodes, cfg, prompt_rows, tokens, trained, logps, rewards, turns, going,
               seed=seed, iteration=iteration, rank=rank, do_sample=do_sample, stage=stage)
        responses = torch.full((rows, limit), pad, dtype=torch.long)
        response_mask = torch.zeros((rows, limit), dtype=torch.long)
        real = torch.zeros((rows, limit), dtype=torch.long)
        rollout_logp = torch.zeros((rows, limit), dtype=torch.float32)
        token_rewards = torch.zeros((rows, limit), dtype=torch.float32)
        for r in range(rows):
            n = len(tokens[r])
            responses[r, :n] = torch.tensor(tokens[r], dtype=torch.long)
            response_mask[r, :n] = torch.tensor(trained[r], dtype=torch.long)
            real[r, :n] = 1
            rollout_logp[r, :n] = torch.tensor(logps[r], dtype=torch.float32)
            token_rewards[r, :n] = torch.tensor(rewards[r], dtype=torch.float32)
        tensors, columns = episodes.columns(rows, {"token_rewards": token_rewards, "response_mask": response_mask})
    finally:
        episodes.close()
    return prompts.with_tensors(
        input_ids=torch.cat([prompt_ids, responses], dim=1),
        attention_mask=torch.cat([prompt_mask, real], dim=1),
        prompt_ids=prompt_ids, responses=responses, response_mask=response_mask, rollout_logp=rollout_logp,
        rollout_version=torch.full((rows,), version, dtype=torch.long), **tensors,
    ).with_columns(turns=[json.dumps(t) for t in turns], **columns)


def _turns(rollout: Any, tokenizer: Any, episodes: Episodes, cfg: RolloutConfig, prompt_rows: list[list[int]],
           tokens: list[list[int]], trained: list[list[int]], logps: list[list[float]], rewards: list[list[float]],
           turns: list[list[dict[str, Any]]], going: list[int], *, seed: int, iteration: int, rank: int,
           do_sample: bool, stage: str) -> None:
    """The turns, appended to each row's lists in place."""
    mt = cfg.multi_turn
    limit, pad = cfg.max_new_tokens, int(tokenizer.pad_token_id)
    stops = set(rollout.stop_ids)
    for turn in range(mt.max_turns):
        going = [r for r in going if len(tokens[r]) < limit]
        if not going:
            break
        budget = limit - min(len(tokens[r]) for r in going)
        params = SamplingParams(budget, do_sample, cfg.temperature, cfg.top_p, cfg.top_k)
        generated: dict[int, tuple[list[int], list[float]]] = {}
        for i in range(0, len(going), cfg.micro_batch_size):
            micro = going[i:i + cfg.micro_batch_size]
            ids, attn = _left_padded([prompt_rows[r] + tokens[r] for r in micro], pad)
            out = rollout.generate(ids, attn, params, derive_seed(seed, iteration, f"{stage}/turn{turn}/{i}", rank))
            for j, r in enumerate(micro):
                keep = out.response_mask[j].bool()
                generated[r] = (out.responses[j][keep].tolist(), out.logp[j][keep].tolist())
        turn_ids, turn_logps, ends, room = [], [], [], []
        for r in going:
            new, lp = generated[r]
            new, lp = new[:limit - len(tokens[r])], lp[:limit - len(tokens[r])]
            cut = episodes.cut(r, new)
            if cut is not None:
                new, lp = new[:cut], lp[:cut]
            tokens[r] += new
            trained[r] += [1] * len(new)
            logps[r] += lp
            rewards[r] += [0.0] * len(new)
            turns[r].append({"role": "assistant", "content": _visible(tokenizer, new)})
            turn_ids.append(new)
            turn_logps.append(lp)
            ends.append(tokenizer.decode(new[-1:], skip_special_tokens=False) if new and new[-1] in stops else "")
            room.append(turn + 1 < mt.max_turns and len(tokens[r]) < limit)
        still = []
        for r, answer in zip(going, episodes.reply(turn, going, turn_ids, ends, room, turn_logps)):
            if tokens[r]:  # the step's reward at the last token of the turn it answers
                rewards[r][-1] += answer.reward
            turns[r][-1].update(answer.step)
            turns[r] += answer.records
            if answer.text is None:
                continue
            ids = tokenizer(answer.text, add_special_tokens=False)["input_ids"]
            ids = ids[:limit - len(tokens[r])]  # at rollout.max_new_tokens the observation is cut
            tokens[r] += ids
            trained[r] += [0] * len(ids)
            logps[r] += [0.0] * len(ids)
            rewards[r] += [0.0] * len(ids)
            if answer.records:
                answer.records[-1]["text"] = tokenizer.decode(ids, skip_special_tokens=False)  # as the model read it
            still.append(r)
        going = still


class ToolEpisodes:
    """Tools as the other side: a turn that ends with a call gets the call's observation (run in the
    sandbox, engine.rollout.tools) as the chat template writes a tool message; a turn without a call, or the
    last turn, ends the row. Adds `tool_calls` and `tool_errors` [B]."""

    def __init__(self, tokenizer: Any, tools: dict[str, tuple[str, ToolSpec]], cfg: RolloutConfig,
                 isolation: Literal["bwrap", "none"]) -> None:
        self.tokenizer, self.tools, self.mt, self.isolation = tokenizer, tools, cfg.multi_turn, isolation
        self.render = observation_renderer(tokenizer, cfg.multi_turn.format)
        self.calls: dict[int, int] = {}
        self.errors: dict[int, int] = {}

    def prompts(self, prompts: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return prompts["input_ids"], prompts["attention_mask"]

    def cut(self, row: int, ids: list[int]) -> int | None:
        return _call_end(self.tokenizer, ids, self.mt.format)

    def reply(self, turn: int, rows: list[int], ids: list[list[int]], ends: list[str], room: list[bool],
              logps: list[list[float]]) -> list[Reply]:
        replies = [Reply(None) for _ in rows]
        pending: list[tuple[int, ToolCall | str]] = []
        for k, (new, go) in enumerate(zip(ids, room)):
            if self.mt.format == "llama3_json":  # the whole turn is the call: read it without the end-of-turn token
                call = parse_tool_call(_visible(self.tokenizer, new), self.mt.format)
            else:
                text = self.tokenizer.decode(new, skip_special_tokens=False)
                call = parse_tool_call(text, self.mt.format) if CALL_END["hermes"] in text else None
            if call is not None and go:
                pending.append((k, call))
        if not pending:
            return replies
        limits = SandboxLimits(timeout_s=self.mt.tool_timeout_s, memory_mb=self.mt.tool_memory_mb,
                               isolation=self.isolation)
        entries: list[tuple[str, ToolCall] | str] = [c if isinstance(c, str) else (str(rows[k]), c) for k, c in pending]
        observations = call_tools(entries, self.tools, limits, self.mt.max_tool_response_chars)
        for (k, _), observation in zip(pending, observations):
            r = rows[k]
            self.calls[r] = self.calls.get(r, 0) + 1
            self.errors[r] = self.errors.get(r, 0) + observation.startswith("error:")
            replies[k] = Reply(self.render(ends[k], observation), [{"role": "tool", "content": observation}])
        return replies

    def close(self) -> None:
        pass

    def columns(self, rows: int, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
        return ({"tool_calls": torch.tensor([self.calls.get(r, 0) for r in range(rows)], dtype=torch.long),
                 "tool_errors": torch.tensor([self.errors.get(r, 0) for r in range(rows)], dtype=torch.long)}, {})


def _left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


def _call_end(tokenizer: Any, ids: list[int], fmt: str) -> int | None:
    """The number of tokens up to and including the first complete tool call's closing text; None if the
    turn closes no call (or the format has no closing text)."""
    end = CALL_END.get(fmt)
    if end is None or end not in tokenizer.decode(ids, skip_special_tokens=False):
        return None
    for k in range(1, len(ids) + 1):
        if end in tokenizer.decode(ids[:k], skip_special_tokens=False):
            return k
    return None


def _visible(tokenizer: Any, ids: list[int]) -> str:
    """A turn's text as a reward reads it: special tokens (eos) left out."""
    return str(tokenizer.decode(ids, skip_special_tokens=True))

