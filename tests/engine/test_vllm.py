"""rollout.name=vllm in one process (no Ray): vLLM's CPU engine against the transformers model it stands
for. Greedy tokens equal and log-probs equal to 1e-5; sampled tokens' log-probs are those of the
distribution sampled (temperature, top-k, top-p), as the hf loop defines them; a seeded call repeats
exactly; after new weights are streamed in (the tied embedding among them), it equals the model again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import VllmConfig
from engine.demo.synthetic import make_rows
from engine.models.loading import load_model, load_tokenizer
from engine.models.tokens import encode_prompts, positions, stop_token_ids
from engine.rollout.backends import make_rollout
from engine.rollout.base import SamplingParams
from engine.rollout.hf import HFRollout, sampling_logits


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path):  # noqa: ANN201
    model = load_model(str(tiny_model_dir))
    tok = load_tokenizer(str(tiny_model_dir))
    stops = sorted(stop_token_ids(tok, model))
    vllm = make_rollout("vllm", None, int(tok.pad_token_id), stops, model_path=str(tiny_model_dir),
                        tokenizer_path=str(tiny_model_dir),
                        cfg=VllmConfig(kv_cache_gib=0.25), max_model_len=128, dtype="float32", seed=0)
    rows = make_rows("arith", 12, seed=3)
    enc = encode_prompts(tok, [r["prompt"] for r in rows])
    return model, HFRollout(model, int(tok.pad_token_id), stops), vllm, enc.input_ids, enc.attention_mask


def _behaviour_logp(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, out, params: SamplingParams  # noqa: ANN001
                    ) -> torch.Tensor:
    """The transformers model's log-prob of each response token under the sampled distribution."""
    full = torch.cat([ids, out.responses], dim=1)
    attn = torch.cat([mask, out.response_mask], dim=1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=attn, position_ids=positions(attn)).logits.float()
    logits = logits[:, ids.shape[1] - 1:-1]  # [B, T, V]: the logits each response token was drawn from
    steps = [torch.log_softmax(sampling_logits(logits[:, t], params), -1).gather(-1, out.responses[:, t:t + 1])
             for t in range(out.responses.shape[1])]
    return torch.where(out.response_mask.bool(), torch.cat(steps, dim=1), torch.zeros(()))


def test_greedy_tokens_and_logprobs_equal_transformers(pair) -> None:  # noqa: ANN001
    model, hf, vllm, ids, mask = pair
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    ours, theirs = hf.generate(ids, mask, params, seed=0), vllm.generate(ids, mask, params, seed=0)
    assert len(set(theirs.response_mask.sum(-1).tolist())) > 1, "rows must end at different steps"
    assert torch.equal(theirs.responses, ours.responses)
    assert torch.equal(theirs.response_mask, ours.response_mask)
    torch.testing.assert_close(theirs.logp, ours.logp, atol=1e-5, rtol=0)


def test_sampled_logprobs_are_of_the_distribution_sampled(pair) -> None:  # noqa: ANN001
    model, _, vllm, ids, mask = pair
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=5, top_p=0.8)
    out = vllm.generate(ids, mask, params, seed=11)
    torch.testing.assert_close(out.logp, _behaviour_logp(model, ids, mask, out, params), atol=1e-4, rtol=0)
    raw = _behaviour_logp(model, ids, mask, out, SamplingParams(max_new_tokens=10))  # untempered, untruncated
    assert (raw - out.logp).abs().max() > 0.05  # so the comparison above could fail
    again = vllm.generate(ids, mask, params, seed=11)
    assert torch.equal(again.responses, out.responses) and torch.equal(again.logp, out.logp)
    other = vllm.generate(ids, mask, params, seed=12)
    assert not torch.equal(other.responses, out.responses)


def test_streamed_weights_replace_the_engines(pair) -> None:  # noqa: ANN001
    model, hf, vllm, ids, mask = pair
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    before = vllm.generate(ids, mask, params, seed=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # the embedding too: tied to the output head in this model
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    assert model.config.tie_word_embeddings
    vllm.load_weights((name, p.detach().clone()) for name, p in model.named_parameters())
    ours, theirs = hf.generate(ids, mask, params, seed=0), vllm.generate(ids, mask, params, seed=0)
    assert (theirs.logp - before.logp).abs().max() > 1e-3  # the weights did change what it computes
    assert torch.equal(theirs.responses, ours.responses)
    torch.testing.assert_close(theirs.logp, ours.logp, atol=1e-5, rtol=0)


def test_a_prompt_past_max_model_len_is_refused(pair) -> None:  # noqa: ANN001
    _, _, vllm, ids, mask = pair
    with pytest.raises(ValueError, match=r"exceeds rollout.vllm.max_model_len=128"):
        vllm.generate(ids, mask, SamplingParams(max_new_tokens=128 - ids.shape[1] + 1), seed=0)


def test_what_vllm_cannot_run_is_refused_in_one_line(tiny_model_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.errors import ConfigError
    from engine.rollout import vllm as backend

    roomy = VllmConfig(kv_cache_gib=0.25)
    backend.check_servable(str(tiny_model_dir), roomy, engines=2, lora_saved=[])  # servable, fits
    own = tmp_path / "own"
    own.mkdir()
    (own / "config.json").write_text('{"architectures": ["TinyRecurrentForCausalLM"], "model_type": "tiny_recurrent"}')
    cases = [
        ((str(own), roomy, 2, []), r"rollout.name=vllm: vLLM \S+ cannot serve .*TinyRecurrentForCausalLM.*; use rollout.name=hf"),
        ((str(tiny_model_dir), VllmConfig(kv_cache_gib=4096), 2, []),
         r"rollout.vllm.kv_cache_gib=4096.0 for 2 vLLM engines needs 8192.0 GiB; this machine has .* GiB free"),
        ((str(tiny_model_dir), VllmConfig(memory_share=0.9), 2, []),
         r"rollout.vllm.memory_share=0.9 \(of .* GiB\) for 2 vLLM engines needs .* GiB; this machine has"),
        ((str(tiny_model_dir), roomy, 2, ["lm_head"]), r"actor.lora.modules_to_save=\['lm_head'\] with rollout.name=vllm: not built"),
    ]
    for (path, cfg, engines, saved), message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            backend.check_servable(path, cfg, engines=engines, lora_saved=saved)
        assert "\n" not in str(err.value)
    real = backend.importlib.util.find_spec
    monkeypatch.setattr(backend.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match=r"rollout.name=vllm: vLLM is not installed; on CPU: pip install"):
        backend.check_servable(str(tiny_model_dir), roomy, engines=2, lora_saved=[])
