"""Partial rollouts (rollout.partial_tokens): a response sampled in two parts, the second from the first
part's sequences with newer weights (tasks/stages.continue_rollouts; the schedule is flows/pipeline.py).
`join_parts` puts the two parts back into one rollout, each token with the version that sampled it."""

from __future__ import annotations

import torch

from engine.batch import Batch


def going_rows(head: Batch) -> torch.Tensor:
    """The rows of the first part whose responses had not finished (engine.workers.policy.generate_batch's
    `finished`): the ones the second part continues."""
    return (head["finished"] == 0).nonzero().squeeze(-1)


def continuation_prompts(head: Batch) -> Batch:
    """The second part's prompts: the going rows' sequences so far (prompt and first part, left padded)."""
    return head.select("input_ids", "attention_mask").index(going_rows(head))


def join_parts(head: Batch, tail: Batch | None, total: int, pad: int, version: int) -> Batch:
    """The rollout of `head` (the first part, [B, P] responses) with `tail` (the going rows' second part,
    [C, total - P], or None when none went on) after it: responses, masks, behaviour log-probs and the
    full sequences [B, P0 + total], and `token_version` [B, total] (the first part's rollout_version on
    its tokens, `version` on the second part's, 0 on padding). Every other column is the head's."""
    rows, first = len(head), head["responses"].shape[1]
    width = head["prompt_ids"].shape[1]
    responses = torch.full((rows, total), pad, dtype=torch.long)
    mask = torch.zeros((rows, total), dtype=torch.long)
    logp = torch.zeros((rows, total), dtype=torch.float32)
    responses[:, :first], mask[:, :first] = head["responses"], head["response_mask"]
    logp[:, :first] = head["rollout_logp"]
    token_version = torch.zeros((rows, total), dtype=torch.long)
    token_version[:, :first] = head["rollout_version"][:, None]
    if tail is not None:
        going = going_rows(head)
        responses[going, first:], mask[going, first:] = tail["responses"], tail["response_mask"]
        logp[going, first:] = tail["rollout_logp"]
        token_version[going, first:] = version
    keep = [k for k in head.keys() if k != "finished"]
    return head.select(*keep).with_tensors(
        input_ids=torch.cat([head["prompt_ids"], responses], dim=1),
        attention_mask=torch.cat([head["attention_mask"][:, :width], mask], dim=1),
        responses=responses, response_mask=mask, rollout_logp=logp, token_version=token_version * mask)
