"""rollout.name=vllm in the engine (Ray, 2 FSDP ranks): a vLLM engine in each policy rank (colocated,
LoRA merged into it) or in each rank of the rollout pool (split). After an update and the weight sync,
vLLM's greedy tokens and log-probs equal the trained model's in transformers; a rollout stage run again
(a retry) regenerates the same sampled tokens; the rollout's log-probs are the trainer's to 1e-4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import RolloutConfig, VllmConfig
from engine.engine import Engine
from engine.models import lora
from engine.models.loading import load_model, load_tokenizer
from engine.models.tokens import stop_token_ids
from engine.rollout.base import SamplingParams
from engine.rollout.hf import HFRollout
from tests.engine.test_engine import make_spec, prompts
from tests.engine.test_lora import LORA

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def trained_model(model_dir: Path, weights: dict[str, torch.Tensor], with_lora: bool) -> torch.nn.Module:
    """The transformers model with the actor's gathered weights (LoRA: the base with its adapters)."""
    model = load_model(str(model_dir))
    if with_lora:
        model, _ = lora.apply_lora(model, LORA, task="CAUSAL_LM", what="actor.lora")
    model.load_state_dict(weights)
    return model.eval()


@pytest.mark.parametrize(("placement", "with_lora"), [("colocated", True), ("split", False)],
                         ids=["colocated-lora", "split-full"])
@pytest.mark.effect_of("rollout.name")
def test_after_a_sync_vllm_generates_as_the_trained_model(ray_address: str, tiny_model_dir: Path,
                                                          placement: str, with_lora: bool) -> None:
    spec = make_spec(tiny_model_dir, f"vllm-{placement}", use_ref=False, **({"lora": LORA} if with_lora else {}))
    rollout = RolloutConfig(name="vllm", max_new_tokens=8, micro_batch_size=8, vllm=VllmConfig(kv_cache_gib=0.25))
    spec = spec.model_copy(update={"policy": spec.policy.model_copy(update={"rollout": rollout, "max_model_len": 96})})
    if placement == "split":
        spec = spec.model_copy(update={"rollout_ranks": 1, "sync_bucket_mb": 0.25})
    engine = Engine.start(spec)
    try:
        batch = engine.generate(prompts(tiny_model_dir), iteration=1, expected_version=0)
        again = engine.generate(prompts(tiny_model_dir), iteration=1, expected_version=0)  # a retried stage
        assert torch.equal(again["responses"], batch["responses"])
        assert torch.equal(again["rollout_logp"], batch["rollout_logp"])
        old = engine.compute_log_prob(batch, expected_version=0)["old_logp"]
        mask = batch["response_mask"].bool()
        assert torch.allclose(batch["rollout_logp"][mask], old[mask], atol=1e-4)  # vLLM's = the trainer's
        adv = torch.linspace(-1, 1, len(batch)).unsqueeze(1) * batch["response_mask"]
        metrics = engine.update_actor(batch.with_tensors(old_logp=old, adv=adv), iteration=1, expected_version=0)
        if placement == "split":
            metrics = engine.sync_weights(1)
            assert engine.versions() == {"policy": 1, "rollout": 1}
        assert metrics["perf/weight_sync_mb"] > 0  # rollout.name=vllm: its engine's own copy (hf from the actor: 0)

        model = trained_model(tiny_model_dir, engine.policy.call("full_weights")[0], with_lora)
        tok = load_tokenizer(str(tiny_model_dir))
        hf = HFRollout(model, int(tok.pad_token_id), sorted(stop_token_ids(tok, model)))
        greedy = engine.generate(prompts(tiny_model_dir), iteration=2, expected_version=1, do_sample=False)
        expected = hf.generate(greedy["prompt_ids"], greedy["attention_mask"][:, :greedy["prompt_ids"].shape[1]],
                               SamplingParams(max_new_tokens=8, do_sample=False), seed=0)
        before = batch["rollout_logp"]
        assert torch.equal(greedy["responses"], expected.responses)
        torch.testing.assert_close(greedy["rollout_logp"], expected.logp, atol=1e-4, rtol=0)
        assert not torch.allclose(old[mask], engine.compute_log_prob(batch, expected_version=1)["old_logp"][mask],
                                  atol=1e-3), "the update must have changed the policy for this to mean anything"
        assert before.shape == greedy["rollout_logp"].shape
    finally:
        engine.stop()
