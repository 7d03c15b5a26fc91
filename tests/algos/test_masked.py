"""Masked reductions, entropy and log-probs: hand-computed cases plus references."""

import math

import torch

from engine.algos import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

NAN = float("nan")


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def test_masked_sum_hand_and_nan_padding():
    x = torch.tensor([[1.0, 2.0, NAN], [4.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_sum(x, mask), 7.0)
    close(masked_sum(x, mask, dim=-1), [3.0, 4.0])


def test_masked_mean_hand():
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    close(masked_mean(x, mask), 3.0)  # (1 + 3 + 5) / 3
    close(masked_mean(x, mask, dim=-1), [2.0, 5.0])
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)  # empty mask -> 0, not NaN


def test_masked_var_hand():
    x = torch.tensor([[1.0, 3.0, 7.0], [5.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # selected {1, 3, 5}: mean 3, squared deviations 4 + 0 + 4 = 8
    close(masked_var(x, mask), 4.0)  # 8 / (3 - 1)
    close(masked_var(x, mask, unbiased=False), 8.0 / 3.0)


def test_masked_var_degenerate_masks_are_finite():
    x = torch.tensor([[2.0, 9.0]])
    close(masked_var(x, torch.tensor([[1, 0]])), 0.0)  # one element (verl would raise)
    close(masked_var(x, torch.tensor([[0, 0]])), 0.0)  # empty


def test_masked_whiten_hand():
    x = torch.tensor([[1.0, 3.0, 50.0], [5.0, 50.0, 50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # mean 3, unbiased std 2 -> (x - 3) / 2 on the selected positions
    out = masked_whiten(x, mask)
    close(out[mask.bool()], [-1.0, 0.0, 1.0])
    out = masked_whiten(x, mask, shift_mean=False)
    close(out[mask.bool()], [2.0, 3.0, 4.0])


def test_masked_whiten_matches_torch_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 7, generator=g) > 0.3
    kept = x[mask]
    expected = (kept - kept.mean()) / torch.sqrt(kept.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(masked_whiten(x, mask)[mask], expected)


def test_entropy_hand():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]]])  # [B=1, T=2, V=4]
    # uniform over 4 -> ln 4;  p = (1/4, 3/4, 0, 0) -> -(1/4 ln 1/4 + 3/4 ln 3/4)
    expected = [[math.log(4.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]]
    close(entropy_from_logits(logits), expected)


def test_entropy_matches_categorical():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(1))
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected)


def test_logprobs_hand():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]]])  # [1, 2, 4]
    labels = torch.tensor([[2, 1]])
    close(logprobs_from_logits(logits, labels), [[math.log(0.25), math.log(0.75)]])


def test_logprobs_match_log_softmax_and_backprop():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 13, generator=g, requires_grad=True)
    labels = torch.randint(0, 13, (3, 5), generator=g)
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    out = logprobs_from_logits(logits, labels)
    torch.testing.assert_close(out, expected)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(grad, expected_grad)


def test_logprobs_bf16_upcast():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 32, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, 32, (2, 4), generator=g)
    out = logprobs_from_logits(logits, labels)
    assert out.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, expected)
