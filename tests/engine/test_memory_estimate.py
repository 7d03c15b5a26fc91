"""The engine's host memory, estimated from config.json before any rank starts (engine/workers/memory.py):
the parameter count of real shapes, each term by hand, a 70B model refused, the real SmolLM2 and the tiny
model admitted. The refusal through `rlflow train` is tests/ops/test_bad_input.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import ActorConfig, RolloutConfig
from engine.errors import ConfigError
from engine.workers.memory import RANK_PROCESS_BYTES, GiB, check_memory, estimate_memory, model_shape
from engine.workers.specs import CriticSpec, PolicySpec

# Llama 2 70B's shape (its config.json, weights not needed): 68,976,648,192 parameters.
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
             "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


@pytest.fixture
def llama_70b(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    return tmp_path


def _policy(path: Path, **update: object) -> PolicySpec:
    return PolicySpec(model_path=str(path), tokenizer_path=str(path), **update)  # type: ignore[arg-type]


def test_parameters_are_counted_from_the_config_alone(llama_70b: Path, smollm2_dir: Path) -> None:
    # 70B: embeddings and head 2 x 32000 x 8192, per layer attention 2 x 8192^2 + 2 x 8192 x 1024, MLP 3 x 8192
    # x 28672, two norms; a final norm.
    layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert model_shape(str(llama_70b)).parameters == 2 * 32000 * 8192 + 80 * layer + 8192 == 68_976_648_192
    smol = model_shape(str(smollm2_dir))  # tied embeddings counted once, as the import's record counts them
    assert smol.parameters == json.loads((smollm2_dir / "rlflow_import.json").read_text())["num_parameters"]
    assert smol.vocab_size == 49152


def test_each_term_by_hand(smollm2_dir: Path) -> None:
    p, v = 134_515_008, 49152
    actor = ActorConfig(micro_batch_size=4)
    policy = _policy(smollm2_dir, actor=actor, use_ref=True, max_model_len=256, max_prompt_length=200)
    est = estimate_memory(policy, None, world_size=2, rollout_ranks=0, host_bytes=24 * GiB)
    assert est.per_rank == {"actor": p * 4 // 2 * 4, "generation": p * 4, "ref": p * 4 // 2, "teacher": 0,
                            "logits": 2 * 4 * 56 * v * 4, "process": RANK_PROCESS_BYTES}
    assert est.total == 2 * sum(est.per_rank.values()) and est.ranks == 2
    # bf16 mixed precision: fp32 shards, a bf16 generation copy; a token budget caps the logits; LoRA trains
    # no base state; vLLM adds its reserve (a share of the host's memory); PPO's critic its own ranks.
    mixed = actor.model_copy(update={"mixed_precision": "bf16", "max_tokens_per_micro_batch": 300,
                                     "packed_sequences": True,  # logits at every position: 4 x 256 > 300
                                     "lora": actor.lora.model_copy(update={"rank": 8})})
    vllm = RolloutConfig(name="vllm", vllm=RolloutConfig().vllm.model_copy(update={"memory_share": 0.25}))
    policy = _policy(smollm2_dir, actor=mixed, rollout=vllm, max_model_len=256)
    critic = CriticSpec(model_path=str(smollm2_dir))
    est = estimate_memory(policy, critic, world_size=2, rollout_ranks=0, host_bytes=24 * GiB)
    assert est.per_rank == {"actor": p * 4 // 2, "generation": p * 2 + 6 * GiB, "ref": 0, "teacher": 0,
                            "logits": 2 * 300 * v * 4, "process": RANK_PROCESS_BYTES}
    assert est.total == 2 * sum(est.per_rank.values()) + 2 * (p * 4 // 2 * 4 + RANK_PROCESS_BYTES)
    assert est.ranks == 4


def test_a_70b_model_is_refused_in_one_line(llama_70b: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        check_memory(_policy(llama_70b), None, world_size=2, rollout_ranks=0, available=24 * GiB)
    message = str(refused.value)
    assert "\n" not in message
    # per rank: shards, gradients, two moments 4 x P x 4 / 2 = 513.9 GiB; the gathered model P x 4 = 257.0
    # GiB; logits 2 x 16 x 1024 x 32000 x 4 = 3.9 GiB; the process 0.5 GiB: 775.3 GiB, two ranks.
    assert ("the engine would need at least 1550.6 GiB for 2 ranks (a policy rank: actor 513.9, generation 257.0, "
            "logits 3.9, process 0.5 GiB)") in message, message
    assert "this machine has 24.0 GiB" in message and "actor.lora.rank>0" in message


def test_smollm2_and_the_tiny_model_fit_this_machine(smollm2_dir: Path, tiny_model_dir: Path) -> None:
    for path in (smollm2_dir, tiny_model_dir):  # W4's lengths: prompts up to 200 tokens, 48 new ones
        policy = _policy(path, use_ref=True, max_model_len=248, max_prompt_length=200)
        estimate = check_memory(policy, None, world_size=2, rollout_ranks=0)
        assert estimate.total < 8 * GiB
