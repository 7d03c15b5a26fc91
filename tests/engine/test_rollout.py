"""The rollout's decode loop (no Ray): the same tokens as transformers' `generate` where both are
deterministic, finished rows leaving the batch without changing the others, and sampling that draws
from the distribution it says (temperature, top-k, top-p)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from engine.demo.synthetic import make_rows
from engine.models.loading import load_model, load_tokenizer
from engine.models.tokens import encode_prompts, stop_token_ids
from engine.rollout.base import SamplingParams
from engine.rollout.hf import HFRollout, sample_next


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path):  # noqa: ANN201
    model = load_model(str(tiny_model_dir))
    tok = load_tokenizer(str(tiny_model_dir))
    stops = sorted(stop_token_ids(tok, model))
    rows = make_rows("arith", 24, seed=3)
    enc = encode_prompts(tok, [r["prompt"] for r in rows])
    return model, tok, HFRollout(model, int(tok.pad_token_id), stops), enc.input_ids, enc.attention_mask


def _hf_generate(model, tok, rollout, ids, mask, max_new: int) -> torch.Tensor:  # noqa: ANN001
    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, pad_token_id=int(tok.pad_token_id),
                           eos_token_id=rollout.stop_ids)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, ids.shape[1]:]
    pad = out.new_full((out.shape[0], max_new - out.shape[1]), int(tok.pad_token_id))
    return torch.cat([out, pad], dim=1)


def test_greedy_matches_transformers_generate_with_rows_ending_at_different_steps(loaded) -> None:  # noqa: ANN001
    model, tok, rollout, ids, mask = loaded
    out = rollout.generate(ids, mask, SamplingParams(max_new_tokens=12, do_sample=False), seed=0)
    lengths = out.response_mask.sum(-1)
    assert len(set(lengths.tolist())) > 1, "the prompts must end at different steps for this test to mean anything"
    assert int(lengths.min()) < 12  # some rows left the batch early
    assert torch.equal(out.responses, _hf_generate(model, tok, rollout, ids, mask, 12))
    # after a row's stop token: padding, masked out
    for row, n in zip(out.responses, lengths.tolist()):
        assert int(row[n - 1]) in rollout.stop_ids or n == 12
        assert (row[n:] == tok.pad_token_id).all()


def test_rows_are_independent_of_the_batch_they_share(loaded) -> None:  # noqa: ANN001
    _, _, rollout, ids, mask = loaded
    params = SamplingParams(max_new_tokens=10, do_sample=False)
    together = rollout.generate(ids, mask, params, seed=0).responses
    alone = torch.cat([rollout.generate(ids[i:i + 1], mask[i:i + 1], params, seed=0).responses
                       for i in range(len(ids))])
    # one row alone has no left padding; it must decode the same tokens
    assert torch.equal(together, alone)


def test_sampling_is_seeded(loaded) -> None:  # noqa: ANN001
    _, _, rollout, ids, mask = loaded
    params = SamplingParams(max_new_tokens=10, temperature=1.5)
    a = rollout.generate(ids, mask, params, seed=7).responses
    b = rollout.generate(ids, mask, params, seed=7).responses
    c = rollout.generate(ids, mask, params, seed=8).responses
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_top_k_one_is_greedy(loaded) -> None:  # noqa: ANN001
    _, _, rollout, ids, mask = loaded
    greedy = rollout.generate(ids, mask, SamplingParams(max_new_tokens=10, do_sample=False), seed=0).responses
    top1 = rollout.generate(ids, mask, SamplingParams(max_new_tokens=10, temperature=3.0, top_k=1), seed=5).responses
    assert torch.equal(greedy, top1)


def test_behaviour_logp_is_of_the_distribution_sampled(loaded) -> None:  # noqa: ANN001
    """The rollout's log-probs are those of the distribution each token was drawn from (after temperature,
    top-k and top-p): with top_k=1 every drawn token had probability 1; with top-k 3 each is its tempered
    probability renormalised over the 3 kept (on main: the tempered one over the whole vocabulary)."""
    model, _, rollout, ids, mask = loaded
    top1 = rollout.generate(ids, mask, SamplingParams(max_new_tokens=6, temperature=3.0, top_k=1), seed=5)
    assert torch.equal(top1.logp, torch.zeros_like(top1.logp))
    params = SamplingParams(max_new_tokens=6, temperature=1.5, top_k=3)
    out = rollout.generate(ids[:4], mask[:4], params, seed=2)
    sequences = torch.cat([ids[:4], out.responses], dim=1)
    full_mask = torch.cat([mask[:4], torch.ones_like(out.responses)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=full_mask).logits[:, ids.shape[1] - 1:-1].float() / 1.5
    kept = logits.topk(3, dim=-1).values  # [4, T, 3]
    chosen = logits.gather(-1, out.responses[..., None])[..., 0]
    by_hand = (chosen - kept.logsumexp(-1)) * out.response_mask
    assert torch.allclose(out.logp, by_hand, atol=1e-4)
    tempered = torch.log_softmax(logits, -1).gather(-1, out.responses[..., None])[..., 0] * out.response_mask
    assert not torch.allclose(out.logp, tempered, atol=1e-3)  # what main recorded differs


def _frequencies(logits: torch.Tensor, params: SamplingParams, draws: int = 40_000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    tokens = sample_next(logits.expand(draws, -1), params, gen)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / draws


def test_draws_follow_the_tempered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    for temperature in (1.0, 0.5):
        expected = torch.softmax(logits[0].double() / temperature, -1)
        got = _frequencies(logits, SamplingParams(max_new_tokens=1, temperature=temperature))
        assert torch.allclose(got, expected, atol=0.01), (temperature, got, expected)


def test_top_k_and_top_p_renormalise_over_the_kept_tokens() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = probs.log().float()[None]
    # top-k 3: the three likeliest, renormalised
    got = _frequencies(logits, SamplingParams(max_new_tokens=1, top_k=3))
    assert got[3] == 0
    assert torch.allclose(got[:3], probs[:3] / probs[:3].sum(), atol=0.01)
    # top-p 0.7: the smallest set whose mass reaches 0.7 is {0.5, 0.3}
    got = _frequencies(logits, SamplingParams(max_new_tokens=1, top_p=0.7))
    assert got[2] == 0 and got[3] == 0
    assert torch.allclose(got[:2], probs[:2] / 0.8, atol=0.01)
    # top-p 0.1: the first token alone
    got = _frequencies(logits, SamplingParams(max_new_tokens=1, top_p=0.1))
    assert got[0] == 1.0
    # permuted vocabulary: the same tokens are kept wherever they sit
    perm = torch.tensor([2, 0, 3, 1])
    got = _frequencies(logits[:, perm], SamplingParams(max_new_tokens=1, top_p=0.7))
    assert torch.allclose(got, (probs[perm] * (probs[perm] >= 0.3)) / 0.8, atol=0.01)


def test_no_stop_token_fills_the_length_and_an_empty_batch_is_empty(loaded) -> None:  # noqa: ANN001
    model, tok, _, ids, mask = loaded
    never = HFRollout(model, int(tok.pad_token_id), stop_ids=[10_000])  # an id the model cannot emit
    out = never.generate(ids[:3], mask[:3], SamplingParams(max_new_tokens=6), seed=0)
    assert out.responses.shape == (3, 6) and bool(out.response_mask.all())
    empty = never.generate(ids[:0], mask[:0], SamplingParams(max_new_tokens=6), seed=0)
    assert empty.responses.shape == (0, 6)


def test_a_response_in_two_parts_is_the_response_in_one(loaded) -> None:  # noqa: ANN001
    """Partial rollouts: greedy with the same weights, P tokens then the rest from the first part's
    sequences (engine.rollout.partial) gives the one-call response, token for token (log-probs within
    float noise: other KV-cache shapes); `finished` marks the rows that ended in the first part, a stop
    token as their last token included; `token_version` is each part's version."""
    from engine.batch import Batch
    from engine.config import RolloutConfig
    from engine.rollout.partial import continuation_prompts, join_parts
    from engine.workers.policy import generate_batch

    model, tok, rollout, ids, mask = loaded
    cfg = RolloutConfig(max_new_tokens=12)
    prompts = Batch({"input_ids": ids, "attention_mask": mask}, {})
    kwargs = {"seed": 0, "iteration": 1, "rank": 0, "do_sample": False}
    whole = generate_batch(rollout, prompts, cfg, version=3, **kwargs)
    lengths = whole["response_mask"].sum(dim=1)
    first = int(lengths.min())  # the shortest response ends with its stop token as the first part's last
    head = generate_batch(rollout, prompts, cfg, version=3, max_new_tokens=first, **kwargs)
    assert head["finished"].tolist() == (lengths <= first).long().tolist()
    assert 0 < int(head["finished"].sum()) < len(head)  # some rows end in the first part, some go on
    tail = generate_batch(rollout, continuation_prompts(head), cfg, version=4, part=1, max_new_tokens=12 - first, **kwargs)
    joined = join_parts(head, tail, 12, int(tok.pad_token_id), version=4)
    for key in ("responses", "response_mask", "input_ids", "attention_mask", "prompt_ids"):
        assert torch.equal(joined[key], whole[key]), key
    assert torch.allclose(joined["rollout_logp"], whole["rollout_logp"], atol=1e-5)
    on = joined["response_mask"].bool()
    want = torch.where(torch.arange(12) < first, 3, 4).expand_as(on)
    assert torch.equal(joined["token_version"][on], want[on]) and bool((joined["token_version"][~on] == 0).all())
    assert "finished" not in joined
