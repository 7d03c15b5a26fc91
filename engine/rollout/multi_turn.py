"""Multi-turn rollouts with tools: assistant -> tool -> assistant, up to rollout.multi_turn.max_turns.

Each turn generates for the rows still going, from their prompt plus everything so far; a turn that ends
with a tool call (rollout.multi_turn.format; hermes' turn is cut right after </tool_call>, llama3_json's
ends at the model's end-of-turn token) has its call run in the sandbox (engine.rollout.tools), and the observation
is appended as the model's chat template writes a tool message (engine.rollout.tools.observation_renderer). A turn
without a call, or the last turn, ends the row. The row's response is all of it, turns and observations, in one token sequence of at
most rollout.max_new_tokens:

    responses      [B, T]  generated and observation tokens, pad after the end
    response_mask  [B, T]  1 on generated tokens only: observations are holes (no loss, no KL; GAE
                           carries values through them), padding 0
    attention_mask [B, P+T] 1 on every real token, observations included (the model reads them)
    rollout_logp   [B, T]  the behaviour log-probs of generated tokens, 0 elsewhere

and the columns `turns` (JSON: [{"role": "assistant" | "tool", "content": ...}, ...] per row; a tool turn's
"text" is its observation as the model read it, in the format's wrapping, cut at the length limit) and the
tensors `tool_calls`, `tool_errors` [B] (calls made, and calls whose observation is an error).

Seeds: each turn's sampling seed is derived from (run seed, iteration, stage, turn, micro-batch, rank), so a
replayed rollout makes the same turns (given deterministic tools).
"""

from __future__ import annotations

import json
from typing import Any, Literal

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


def generate_multi_turn(rollout: Any, tokenizer: Any, tools: dict[str, tuple[str, ToolSpec]], prompts: Batch,
                        cfg: RolloutConfig, *, seed: int, iteration: int, rank: int, do_sample: bool, version: int,
                        stage: str, isolation: Literal["bwrap", "none"] = "bwrap") -> Batch:
    mt = cfg.multi_turn
    limit, pad = cfg.max_new_tokens, int(tokenizer.pad_token_id)
    render = observation_renderer(tokenizer, mt.format)
    stops = set(rollout.stop_ids)
    rows = len(prompts)
    prompt_rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompts["input_ids"], prompts["attention_mask"])]
    tokens: list[list[int]] = [[] for _ in range(rows)]
    trained: list[list[int]] = [[] for _ in range(rows)]
    logps: list[list[float]] = [[] for _ in range(rows)]
    turns: list[list[dict[str, str]]] = [[] for _ in range(rows)]
    calls, errors = [0] * rows, [0] * rows
    going = list(range(rows))
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
        pending: list[tuple[int, ToolCall | str]] = []
        ended: dict[int, str] = {}  # the stop token a calling turn ended with, as text ("" if cut at the call)
        still = []
        for r in going:
            new, lp = generated[r]
            new, lp = new[:limit - len(tokens[r])], lp[:limit - len(tokens[r])]
            cut = _call_end(tokenizer, new, mt.format)
            if cut is not None:
                new, lp = new[:cut], lp[:cut]
            text = tokenizer.decode(new, skip_special_tokens=False)
            tokens[r] += new
            trained[r] += [1] * len(new)
            logps[r] += lp
            turns[r].append({"role": "assistant", "content": _visible(tokenizer, new)})
            if mt.format == "llama3_json":  # the whole turn is the call: read it without the end-of-turn token
                call = parse_tool_call(_visible(tokenizer, new), mt.format)
            else:
                call = parse_tool_call(text, mt.format) if cut is not None else None
            if call is not None and turn + 1 < mt.max_turns and len(tokens[r]) < limit:
                pending.append((r, call))
                ended[r] = tokenizer.decode(new[-1:], skip_special_tokens=False) if new and new[-1] in stops else ""
                still.append(r)
        if pending:
            limits = SandboxLimits(timeout_s=mt.tool_timeout_s, memory_mb=mt.tool_memory_mb, isolation=isolation)
            entries: list[tuple[str, ToolCall] | str] = [c if isinstance(c, str) else (str(r), c) for r, c in pending]
            observations = call_tools(entries, tools, limits, mt.max_tool_response_chars)
            for (r, _), observation in zip(pending, observations):
                calls[r] += 1
                errors[r] += observation.startswith("error:")
                ids = tokenizer(render(ended[r], observation), add_special_tokens=False)["input_ids"]
                ids = ids[:limit - len(tokens[r])]  # at rollout.max_new_tokens the observation is cut
                tokens[r] += ids
                trained[r] += [0] * len(ids)
                logps[r] += [0.0] * len(ids)
                turns[r].append({"role": "tool", "content": observation,
                                 "text": tokenizer.decode(ids, skip_special_tokens=False)})  # as the model read it
        going = still
    responses = torch.full((rows, limit), pad, dtype=torch.long)
    response_mask = torch.zeros((rows, limit), dtype=torch.long)
    real = torch.zeros((rows, limit), dtype=torch.long)
    rollout_logp = torch.zeros((rows, limit), dtype=torch.float32)
    for r in range(rows):
        n = len(tokens[r])
        responses[r, :n] = torch.tensor(tokens[r], dtype=torch.long)
        response_mask[r, :n] = torch.tensor(trained[r], dtype=torch.long)
        real[r, :n] = 1
        rollout_logp[r, :n] = torch.tensor(logps[r], dtype=torch.float32)
    return prompts.with_tensors(
        prompt_ids=prompts["input_ids"],
        input_ids=torch.cat([prompts["input_ids"], responses], dim=1),
        attention_mask=torch.cat([prompts["attention_mask"], real], dim=1),
        responses=responses, response_mask=response_mask, rollout_logp=rollout_logp,
        rollout_version=torch.full((rows,), version, dtype=torch.long),
        tool_calls=torch.tensor(calls, dtype=torch.long), tool_errors=torch.tensor(errors, dtype=torch.long),
    ).with_columns(turns=[json.dumps(t) for t in turns])


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

