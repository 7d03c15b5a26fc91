"""LoRA (peft) in the hybrid engine: only the adapters train, the reference is the base model with the
adapters off (no second copy), the rollout copy receives the adapters only, checkpoints hold the
adapters only, and the export is peft's adapter folder plus, on request, the merged weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from engine import algos
from engine.batch import Batch
from engine.config import CriticConfig, LoraConfig
from engine.engine import Engine, EngineSpec
from engine.workers.critic import CriticSpec
from engine.workers.policy import response_logits
from tests.engine.test_engine import make_spec, prompts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LORA = LoraConfig(rank=4, alpha=8)


def lora_spec(model_dir: Path, run_id: str, **kw: object) -> EngineSpec:
    return make_spec(model_dir, run_id, lora=LORA, **kw)


def train_batch(engine: Engine, model_dir: Path) -> tuple[Batch, Batch]:
    batch = engine.generate(prompts(model_dir), iteration=1, expected_version=0)
    old = engine.compute_log_prob(batch, expected_version=0)
    adv = torch.linspace(-1, 1, 8).unsqueeze(1) * batch["response_mask"]
    return batch, batch.with_tensors(old_logp=old["old_logp"], adv=adv)


@pytest.fixture(scope="module")
def updated(ray_address: str, tiny_model_dir: Path):  # noqa: ANN201
    """A LoRA engine (2 ranks, KL on, rollout copy) after one update, its batch, and a full fine-tuning
    engine of the same spec otherwise, before any update."""
    lora_eng = Engine.start(lora_spec(tiny_model_dir, "lora", rollout_weights="copy"))
    full_eng = Engine.start(make_spec(tiny_model_dir, "lora-full"))
    try:
        batch, train = train_batch(lora_eng, tiny_model_dir)
        before = lora_eng.policy.call("full_weights")[0]
        metrics = lora_eng.update_actor(train, iteration=1, expected_version=0)
        yield {"lora": lora_eng, "full": full_eng, "batch": batch, "train": train, "before": before,
               "metrics": metrics}
    finally:
        lora_eng.stop()
        full_eng.stop()


def test_only_the_adapters_train(updated: dict, tiny_model_dir: Path) -> None:
    after = updated["lora"].policy.call("full_weights")[0]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    adapters = [k for k in after if "lora_" in k]
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    for key, value in after.items():
        if "lora_" in key:
            continue
        # peft names the wrapped layer's weight `<layer>.base_layer.weight`
        assert torch.equal(value, base[key.replace(".base_layer", "")]), key  # the base is frozen, bit for bit
    moved = {k for k in adapters if not torch.equal(after[k], updated["before"][k])}
    # lora_B starts at 0, so the first step moves every B (A's gradient is B^T times something: 0)
    assert moved == {k for k in adapters if ".lora_B." in k}
    mem = updated["lora"].policy.call("memory_bytes")
    for rank in mem:  # AdamW holds 2 moments of the adapters only (+ one step counter per tensor)
        assert rank["optimizer"] <= 2 * rank["trainable_params"] + 8 * len(adapters)
        assert rank["trainable_params"] < 0.2 * rank["params"]


def test_ref_is_the_base_model_exactly_and_holds_no_second_copy(updated: dict) -> None:
    lora, full, batch = updated["lora"], updated["full"], updated["batch"]
    ref = lora.compute_ref_log_prob(batch)["ref_logp"]
    base = full.compute_ref_log_prob(batch)["ref_logp"]  # a separate reference model of the base weights
    assert torch.equal(ref, base)  # exactly: adapters off run the base layers alone
    actor = lora.compute_log_prob(batch, expected_version=1)["old_logp"]
    mask = batch["response_mask"].bool()
    assert float((actor - ref)[mask].abs().max()) > 1e-4  # the adapters do change the policy
    # Per-rank memory, LoRA + KL against full fine-tuning + KL (after one update: AdamW's moments exist).
    full.update_actor(updated["train"], iteration=1, expected_version=0)
    for lora_mem, full_mem in zip(lora.policy.call("memory_bytes"), full.policy.call("memory_bytes")):
        assert lora_mem["ref"] == 0 and full_mem["ref"] > 0
        lora_total = lora_mem["params"] + lora_mem["optimizer"] + lora_mem["ref"]
        full_total = full_mem["params"] + full_mem["optimizer"] + full_mem["ref"]
        print(f"held bytes per rank: LoRA + KL {lora_total}, full + KL {full_total} ({lora_total / full_total:.2f})")
        assert lora_total < 0.5 * full_total


def test_rollout_copy_receives_the_adapters_only(updated: dict) -> None:
    lora, batch, metrics = updated["lora"], updated["batch"], updated["metrics"]
    adapter_mb = sum(t.numel() * t.element_size() for k, t in updated["before"].items() if "lora_" in k) / 2**20
    full_mb = sum(t.numel() * t.element_size() for t in updated["before"].values()) / 2**20
    assert metrics["perf/weight_sync_mb"] == pytest.approx(adapter_mb)
    assert adapter_mb < 0.2 * full_mb
    # what the sync gathers (all adapters in one collective) is the actor's adapters, bit for bit
    full = lora.policy.call("full_weights")[0]
    for gathered in lora.policy.call("trainable_weights"):
        assert gathered.keys() == {k for k in full if "lora_" in k}
        assert all(torch.equal(gathered[k], full[k]) for k in gathered)
    # the copy generates with base + current adapters: its log-probs are the actor's
    actor = lora.compute_log_prob(batch, expected_version=1)["old_logp"]
    rollout = lora.policy.call("rollout_log_prob", batch, mode="dp")["logp"]
    mask = batch["response_mask"].bool()
    assert float((actor - rollout)[mask].abs().max()) <= 1e-5


def test_export_is_a_peft_adapter_folder_and_merged_weights(updated: dict, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    import peft

    lora, batch = updated["lora"], updated["batch"]
    lora.export_hf(str(tmp_path / "adapter"), merged_url=str(tmp_path / "merged"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(tiny_model_dir)
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    actor = lora.compute_log_prob(batch, expected_version=1)["old_logp"]
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                                tmp_path / "adapter").eval()
        peft_logp = algos.logprobs_from_logits(response_logits(loaded, batch, 1.0, "padded"), batch["responses"])
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        merged_logp = algos.logprobs_from_logits(response_logits(merged, batch, 1.0, "padded"), batch["responses"])
    assert not any("lora" in k for k in merged.state_dict())
    assert float((actor - peft_logp)[mask].abs().max()) <= 1e-5
    assert float((actor - merged_logp)[mask].abs().max()) <= 1e-5


def test_adapter_only_checkpoint_restores_a_bit_identical_next_update(updated: dict, ray_address: str,
                                                                    tiny_model_dir: Path, tmp_path: Path) -> None:
    lora, train = updated["lora"], updated["train"]
    url = tmp_path / "ckpt"
    records = lora.save(str(url))
    adapter_bytes = sum(t.numel() * t.element_size() for k, t in updated["before"].items() if "lora_" in k)
    full_bytes = sum(t.numel() * t.element_size() for t in updated["before"].values())
    stored = sum(r["size"] for r in records)
    print(f"LoRA checkpoint {stored} bytes; adapters {adapter_bytes}, full weights {full_bytes}")
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(url / "policy")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)  # no base weight, not even the tied head
    assert not [k for k in keys if k.startswith("optim.state.") and "lora_" not in k]
    assert stored < 0.5 * full_bytes  # the weights alone of full fine-tuning (its checkpoint is 3x that)
    saved = lora.weights_digest()
    updated["full"].stop()  # its CPUs for the second engine (the head has 4)
    second = Engine.start(lora_spec(tiny_model_dir, "lora-load", rollout_weights="copy"))
    try:
        expected = {r["path"][len("policy/"):]: (r["size"], r["sha256"]) for r in records}
        assert second.policy.call("load", str(url / "policy"), {}, expected)[0] == 1
        assert second.weights_digest() == saved
        lora.update_actor(train, iteration=2, expected_version=1)
        second.update_actor(train, iteration=2, expected_version=1)
        assert second.weights_digest() == lora.weights_digest()
    finally:
        second.stop()


def test_critic_with_lora_trains_adapters_and_its_value_head(updated: dict, tiny_model_dir: Path) -> None:
    updated["full"].stop()  # its CPUs (the LoRA engine keeps 2 of the head's 4)
    spec = make_spec(tiny_model_dir, "lora-critic", world_size=1, use_ref=False, critic=True)
    critic = CriticSpec(model_path=str(tiny_model_dir), critic=CriticConfig(lr=1e-3, mini_batch_size=8,
                                                                           micro_batch_size=4, lora=LORA))
    eng = Engine.start(spec.model_copy(update={"critic": critic}))
    try:
        batch = eng.generate(prompts(tiny_model_dir), iteration=1, expected_version=0)
        values = eng.compute_values(batch, expected_version=0)["values"]
        train = batch.with_tensors(values=values, returns=torch.ones(8, 8) * batch["response_mask"])
        before = eng.critic.call("full_weights")[0]
        first = eng.update_critic(train, iteration=1, expected_version=0)
        for it in range(2, 6):
            last = eng.update_critic(train, iteration=it, expected_version=it - 1)
        after = eng.critic.call("full_weights")[0]
    finally:
        eng.stop()
    assert last["critic/vf_loss"] < first["critic/vf_loss"]
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed and all("lora_" in k or "modules_to_save" in k for k in changed), sorted(changed)[:5]
    assert any("modules_to_save" in k for k in changed)  # the value head trains in full


@pytest.mark.effect_of("actor.lora.modules_to_save")
def test_modules_to_save_train_in_full_next_to_the_adapters(updated: dict, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    """actor.lora.modules_to_save=[lm_head] on a model whose head is tied to its embeddings: the head
    trains as its own copy, the embeddings stay the base's, and the checkpoint and the export hold the
    trained head (and not the frozen embedding matrix)."""
    updated["full"].stop()  # its CPUs (the LoRA engine keeps 2 of the head's 4)
    updated["lora"].stop()  # 2 ranks here: the head's 103 rows split unevenly (52 + 51) across them
    spec = make_spec(tiny_model_dir, "lora-head", world_size=2, use_ref=False,
                     lora=LoraConfig(rank=4, alpha=8, modules_to_save=["lm_head"]))
    eng = Engine.start(spec)
    try:
        _, train = train_batch(eng, tiny_model_dir)
        before = eng.policy.call("full_weights")[0]
        eng.update_actor(train, iteration=1, expected_version=0)
        after = eng.policy.call("full_weights")[0]
        for gathered in eng.policy.call("trainable_weights"):  # one all-gather of uneven shards
            assert "lm_head.modules_to_save.default.weight" in gathered
            assert all(torch.equal(gathered[k], after[k]) for k in gathered)
        records = eng.save(str(tmp_path / "ckpt"))
        eng.export_hf(str(tmp_path / "adapter"))
    finally:
        eng.stop()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert "lm_head.modules_to_save.default.weight" in changed
    assert all(".lora_B." in k or "modules_to_save" in k for k in changed), sorted(changed)
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(tmp_path / "ckpt" / "policy")).read_metadata().state_dict_metadata
    assert "model.lm_head.modules_to_save.default.weight" in keys
    assert not [k for k in keys if k.startswith("model.") and "lora_" not in k and "modules_to_save" not in k]
    assert sum(r["size"] for r in records) > 0
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any("lm_head" in k for k in saved) and not any("embed_tokens" in k for k in saved)
