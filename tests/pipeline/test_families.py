"""Any causal LM of the Hub's common families: a tiny random model of each (engine/demo/families.py: its own
byte-level BPE tokenizer, chat template, eos and pad tokens, tied embeddings or not) trains one GRPO
iteration (and a validation) on 2 ranks through the pipeline, and its export loads with plain `transformers`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.batch import Batch
from engine.demo.families import FAMILIES, build_family
from engine.demo.synthetic import make_rows
from tests.services import WarmCli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
HERE = Path(__file__).resolve().parent


def overrides(model: Path, root: Path, run_id: str) -> list[str]:
    return [f"model.path={model}", f"storage.root={root}", f"trainer.run_id={run_id}", "data.task=sort",
            "trainer.total_iterations=1", "trainer.save_every=1", "trainer.val_every=1", "trainer.world_size=2",
            "data.train_size=64", "data.val_size=8", "data.train_batch_size=4", "rollout.n=4",
            "rollout.max_new_tokens=16", "data.max_prompt_length=128", "actor.mini_batch_size=16",
            "actor.micro_batch_size=16", "actor.lr=1e-3", "rollout.val_do_sample=false",
            f"reward.function={HERE / 'rewards.py'}:digit_share"]  # varies in every group


@pytest.fixture(scope="module")
def runs(warm_cli: WarmCli, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every family's model built, then trained one after another in the session's warm CLI process."""
    models = tmp_path_factory.mktemp("families")
    root = tmp_path_factory.mktemp("family-runs")
    results = {}
    for name in FAMILIES:
        build_family(name, models / name, task="sort", seed=0)
        proc = warm_cli("train", *overrides(models / name, root, f"family-{name}"))
        assert proc.returncode == 0, f"{name}:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
        done = re.search(r"finished iteration (\d+); storage \S+; export (\S+)", proc.stdout)
        assert done, proc.stdout[-2000:]
        results[name] = {"finished_iteration": int(done[1]), "export": done[2]}
    return {"models": models, "root": root, "results": results}


def buffer(runs: dict, family: str, iteration: int, name: str) -> Batch:
    return Batch.from_parquet(str(runs["root"] / f"family-{family}" / "buffers" / f"iter_{iteration:06d}" / f"{name}.parquet"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_and_exports(runs: dict, family: str) -> None:
    spec = FAMILIES[family]
    result = runs["results"][family]
    assert result["finished_iteration"] == 1 and result["export"]
    source = runs["models"] / family
    export = Path(result["export"])
    model = AutoModelForCausalLM.from_pretrained(export)  # plain transformers, nothing of ours
    tokenizer = AutoTokenizer.from_pretrained(export)
    original = AutoTokenizer.from_pretrained(source)
    assert tokenizer.chat_template == original.chat_template and tokenizer.eos_token == original.eos_token
    assert type(model).__name__ == type(AutoModelForCausalLM.from_pretrained(source)).__name__

    # Trained, and tied embeddings stay one tensor through FSDP2, the optimizer and the export.
    before, after = load_file(source / "model.safetensors"), load_file(export / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert model.config.tie_word_embeddings is spec.tie_word_embeddings
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if spec.tie_word_embeddings:
        assert embed.data_ptr() == head.data_ptr()
    else:
        assert not torch.equal(embed, head)

    # The chat template is applied the same way for the rollout and for validation: the prompt tokens
    # of both are the template's, and responses end at the family's stop tokens (tokenizer eos and
    # generation_config eos), nothing after them counted.
    stops = {original.convert_tokens_to_ids(t) for t in spec.generation_eos}
    for name, split, size in (("rollout", "train", 64), ("validation", "val", 8)):
        batch = buffer(runs, family, 1, name)
        rows = make_rows("sort", size, seed=0, split=split)
        width = batch["prompt_ids"].shape[1]
        for row in range(len(batch)):
            ids = batch["prompt_ids"][row][batch["attention_mask"][row, :width].bool()].tolist()
            messages = rows[int(batch["row_index"][row])]["prompt"]
            assert ids == template_ids(original, messages), (name, row)
        for response, mask in zip(batch["responses"].tolist(), batch["response_mask"].tolist()):
            n = sum(mask)
            ended = [i for i, t in enumerate(response) if t in stops]
            assert n == (ended[0] + 1 if ended else len(response))


def template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The family's own template on the row's messages (GPT-2 has none: the text, with its specials)."""
    if tokenizer.chat_template is None:
        return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
