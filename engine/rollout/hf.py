"""rollout.name=hf: our own decode loop over a transformers model (the actor itself or a copy)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import DynamicCache, PreTrainedModel

from engine.models.tokens import cache_argument, positions
from engine.rollout.base import RolloutOutput, SamplingParams, response_mask_until_eos


class HFRollout:
    """Sampling with a KV cache on an unsharded transformers copy of the policy (CPU or one GPU).

    Our own decode loop rather than `generate`: a row that has emitted a stop token leaves the batch
    (its KV cache rows are dropped), so each step costs the rows still generating, not the whole batch
    until its longest response ends. With responses of ~10 tokens and a longest of ~17 that halves the
    generation time of a 256-row call on CPU. The sampling is `generate`'s: logits / temperature, then
    top-k, then top-p (nucleus), then a draw; greedy takes the argmax.
    """

    def __init__(self, model: PreTrainedModel, pad_token_id: int, stop_ids: list[int]) -> None:
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.stop_ids = sorted(stop_ids)
        self._cache_arg = cache_argument(model)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> int:
        """The new weights: all of them (strict: a renamed or missing weight must fail here, not generate
        from stale values), or with `partial` a part (LoRA: the adapters), each name known to the model."""
        state = dict(weights)
        result = self.model.load_state_dict(state, strict=not partial)
        if result.unexpected_keys:
            raise RuntimeError(f"the rollout model has no {result.unexpected_keys[:3]}")
        return sum(t.numel() * t.element_size() for t in state.values())

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, seed: int
    ) -> RolloutOutput:
        """input_ids, attention_mask: [B, P] left padded. Returns [B, T] with T = max_new_tokens."""
        rows, length = input_ids.shape[0], params.max_new_tokens
        responses = input_ids.new_full((rows, length), self.pad_token_id)
        logp = torch.zeros((rows, length), dtype=torch.float32, device=input_ids.device)
        if rows == 0:
            return RolloutOutput(responses, torch.zeros_like(responses), torch.zeros(responses.shape))
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
        stops = torch.tensor(self.stop_ids, dtype=input_ids.dtype, device=input_ids.device)
        cache = DynamicCache(config=self.model.config)
        position_ids = positions(attention_mask)
        logits = self._last_logits(input_ids, attention_mask, position_ids, cache)  # prefill
        alive = torch.arange(rows, device=input_ids.device)  # original row of each row still generating
        position, mask = position_ids[:, -1], attention_mask
        for t in range(length):
            drawn_from = sampling_logits(logits, params)  # what the draw below samples from
            token = draw(drawn_from, params, generator)  # [alive]
            responses[alive, t] = token
            logp[alive, t] = torch.log_softmax(drawn_from, dim=-1).gather(-1, token[:, None])[:, 0]
            ended = torch.isin(token, stops)
            if t == length - 1:
                break
            if bool(ended.any()):
                keep = (~ended).nonzero().squeeze(-1)
                if len(keep) == 0:
                    break
                cache.batch_select_indices(keep)  # finished rows leave the batch
                alive, token, position, mask = alive[keep], token[keep], position[keep], mask[keep]
            position = position + 1
            mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=1)
            logits = self._last_logits(token[:, None], mask, position[:, None], cache)
        response_mask = response_mask_until_eos(responses, self.stop_ids)
        return RolloutOutput(responses, response_mask, logp * response_mask)

    def _last_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                     cache: DynamicCache) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
        return out.logits[:, -1].float()  # [b, V]

    def sleep(self) -> None:
        """Nothing to release for an in-process transformers model."""

    def wake(self) -> None:
        """Nothing to restore for an in-process transformers model."""


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """[b, V] logits -> [b] next tokens: greedy, or a draw after temperature, top-k and top-p."""
    return draw(sampling_logits(logits, params), params, generator)


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """[b, V] logits of the sampling distribution (sampling_logits) -> [b] tokens: the argmax when greedy."""
    if not params.do_sample:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


def sampling_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[b, V] logits -> the logits of the distribution a token is drawn from: / temperature, then top-k
    and top-p (nucleus) set what they drop to -inf (sampling only; greedy: / temperature alone). Its
    log_softmax is the behaviour log-prob of the drawn token (engine.algos.correction)."""
    logits = logits / params.temperature
    if not params.do_sample:
        return logits
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [b, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
        drop = before >= params.top_p  # the first token is always kept (before = 0)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits
