"""Loading models and tokenizers, prompts to left-padded tokens, responses to text, the tiny cache."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.config import ModelConfig
from engine.cpu_kernels import AVX2_ENV, has_avx2, kernel_env, kernel_tag
from engine.demo import tiny
from engine.demo.tiny import resolve_model_path
from engine.errors import ConfigError
from engine.models.loading import (
    ModelLoadError,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    model_identity,
    prepare_tokenizer,
)
from engine.models.tokens import decode_responses, encode_prompts, prompt_lengths, prompt_text

CHAT = [{"role": "user", "content": "12+345="}]


def _tokenizer_without_pad(directory: Path) -> Path:
    vocab = {t: i for i, t in enumerate(["</s>", "<unk>", *"0123456789+="])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="<unk>").save_pretrained(
        directory
    )
    return directory


def test_missing_pad_token_uses_eos_with_a_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="rlflow.models"):
        tokenizer = load_tokenizer(str(_tokenizer_without_pad(tmp_path / "tok")))
    assert tokenizer.pad_token == "</s>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"
    assert any("no pad token" in r.getMessage() and r.name == "rlflow.models" for r in caplog.records)
    enc = encode_prompts(tokenizer, ["1+1=", "12+34="])  # pads with eos
    assert enc.input_ids[0, :2].tolist() == [tokenizer.eos_token_id] * 2


def test_no_pad_and_no_eos_is_a_clear_error() -> None:
    core = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    with pytest.raises(ModelLoadError, match="neither a pad nor an eos"):
        prepare_tokenizer(PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>"))


def test_chat_prompts_use_the_template(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_dir))
    assert prompt_text(tokenizer, CHAT) == "<s><|user|>12+345=<|assistant|>"
    ids = encode_prompts(tokenizer, [CHAT]).input_ids[0].tolist()
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1  # no double bos
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")


def test_plain_text_without_a_chat_template(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_dir))
    tokenizer.chat_template = None
    two = [{"role": "system", "content": "be brief"}, *CHAT]
    assert prompt_text(tokenizer, two) == "be brief\n12+345="
    assert prompt_text(tokenizer, "3+4=") == "3+4="
    ids = encode_prompts(tokenizer, ["3+4="]).input_ids[0].tolist()
    assert tokenizer.convert_ids_to_tokens(ids) == ["<s>", "3", "+", "4", "="]  # the tokenizer adds bos


def test_left_padding_and_prompt_lengths(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_dir))
    prompts = [[{"role": "user", "content": "1+2="}], [{"role": "user", "content": "123+456="}]]
    enc = encode_prompts(tokenizer, prompts)
    lengths = prompt_lengths(tokenizer, prompts)
    assert lengths == [7, 11] and enc.input_ids.shape == (2, 11)
    assert enc.attention_mask.tolist()[0] == [0] * 4 + [1] * 7
    assert enc.input_ids[0, :4].tolist() == [tokenizer.pad_token_id] * 4
    assert bool(enc.attention_mask[:, -1].all())  # every prompt ends in the last column
    assert enc.input_ids.dtype == enc.attention_mask.dtype == torch.long


def test_decode_responses_cuts_at_eos_and_drops_pads(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_dir))

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = [ids("#### 357") + [eos, pad], ids("#### 4") + [eos] + ids("999"), ids("#### 12") + [pad] * 3]
    assert decode_responses(tokenizer, torch.tensor(rows)) == ["#### 357", "#### 4", "#### 12"]
    assert decode_responses(tokenizer, [ids("12")], stop_ids={ids("2")[0]}) == ["1"]


def test_generate_with_the_loaded_pair(tiny_dir: Path) -> None:
    model, tokenizer = load_model_and_tokenizer(ModelConfig(path=str(tiny_dir)))
    enc = encode_prompts(tokenizer, [CHAT, [{"role": "user", "content": "1+1="}]])
    out = model.generate(
        input_ids=enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=4, do_sample=False
    )
    texts = decode_responses(tokenizer, out[:, enc.input_ids.shape[1] :])
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert not model.training


def test_dtype_from_config(tiny_dir: Path) -> None:
    model = load_model(str(tiny_dir), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_missing_local_path_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError, match=f"model.path '{missing}': no such directory"):
        resolve_model_path(ModelConfig(path=missing), task="arith")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"'someorg/some-model'.*hub is offline"):
        resolve_model_path(ModelConfig(path="someorg/some-model"), task="arith")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="cannot load a causal LM from"):
        load_model(str(tmp_path / "empty"))


def quick_tiny_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """A cache of its own, and tiny builds of 2 warm-start steps: the folders built, in order."""
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))
    real_build, builds = tiny.build_tiny, []

    def quick_build(out_dir: Path, task: str, seed: int, steps: int | None = None) -> tiny.TinyReport:
        builds.append(out_dir)
        return real_build(out_dir, task, seed, steps=2)

    monkeypatch.setattr(tiny, "build_tiny", quick_build)
    return builds


def test_tiny_is_built_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds = quick_tiny_builds(tmp_path, monkeypatch)
    cfg = ModelConfig(path="tiny", tiny_seed=3)
    first = resolve_model_path(cfg, task="sort")
    tag = kernel_tag(dict(os.environ))
    assert Path(first) == tmp_path / "cache" / "models" / f"tiny-sort-s3-{tiny.builder_digest()}-{tag}"
    mtime = os.stat(Path(first) / tiny.REPORT_FILE).st_mtime_ns
    assert resolve_model_path(cfg, task="sort") == first
    assert len(builds) == 1 and os.stat(Path(first) / tiny.REPORT_FILE).st_mtime_ns == mtime
    assert tiny.read_report(first).task == "sort"
    leftovers = [p.name for p in (tmp_path / "cache" / "models").iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_a_swapped_cache_file_of_the_same_size_and_mtime_is_found(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's cache and the base-model hash cache check contents, not sizes and times (issue 47):
    a weights file swapped for one of the same size and mtime is rebuilt, and its identity hashed again."""
    builds = quick_tiny_builds(tmp_path, monkeypatch)
    cfg = ModelConfig(path="tiny", tiny_seed=3)
    path = Path(resolve_model_path(cfg, task="sort"))
    weights = path / "model.safetensors"
    original, stat = weights.read_bytes(), weights.stat()
    identity = model_identity(str(path))
    swapped = bytearray(original)
    swapped[-8] ^= 0xFF  # a weight's bytes (the header is at the start)
    weights.write_bytes(bytes(swapped))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)

    assert model_identity(str(path))["sha256"] != identity["sha256"]
    with pytest.warns(UserWarning, match=r"model.safetensors is not the file the build wrote\): building it again"):
        assert Path(resolve_model_path(cfg, task="sort")) == path
    assert len(builds) == 2 and weights.read_bytes() == original
    assert model_identity(str(path)) == identity


def test_an_edited_builder_never_reuses_a_cached_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache name carries the builder's source: one edited character is another build."""
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))
    before = tiny.tiny_cache_path("sort", 0)
    copy = tmp_path / "src"
    copy.mkdir()
    for name in tiny.BUILDER_FILES:
        (copy / name).write_bytes(Path(tiny.__file__).with_name(name).read_bytes())
    monkeypatch.setattr(tiny, "__file__", str(copy / "tiny.py"))
    assert tiny.tiny_cache_path("sort", 0) == before  # the same source, the same build
    with open(copy / "synthetic.py", "a") as handle:
        handle.write("\n# edited\n")
    assert tiny.tiny_cache_path("sort", 0) != before
    # and the kernels a build runs with are part of its name
    assert tiny.tiny_cache_path("sort", 0, {}).name.endswith("-native")
    assert tiny.tiny_cache_path("sort", 0, dict(AVX2_ENV)).name.endswith("-avx2")


def test_cpu_kernels_modes() -> None:
    assert kernel_env("native") == {}
    assert kernel_env("auto") == (dict(AVX2_ENV) if has_avx2() else {})
    with pytest.raises(ConfigError, match=r"placement.cpu_kernels='sse'; allowed: auto, avx2, native"):
        kernel_env("sse")
    if has_avx2():
        assert kernel_env("avx2") == AVX2_ENV
    else:
        with pytest.raises(ConfigError, match="this CPU has no AVX2"):
            kernel_env("avx2")


def test_a_half_built_cache_entry_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path))
    real_build = tiny.build_tiny
    monkeypatch.setattr(tiny, "build_tiny", lambda out, task, seed: real_build(out, task, seed, steps=1))
    half = tiny.tiny_cache_path("arith", 0)
    half.mkdir(parents=True)
    (half / "config.json").write_text("{")  # no report: never finished
    dead = half.parent / f".{half.name}.tmp-dead"  # the temp dir of a builder that was killed
    dead.mkdir()
    path = resolve_model_path(ModelConfig(path="tiny"), task="arith")
    assert tiny.read_report(path).steps == 1
    assert not dead.exists()


def test_concurrent_resolves_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path))
    real_build, builds = tiny.build_tiny, []

    def slow_quick_build(out: Path, task: str, seed: int) -> tiny.TinyReport:
        builds.append(out)
        time.sleep(0.5)  # both callers arrive while the first one builds
        return real_build(out, task, seed, steps=1)

    monkeypatch.setattr(tiny, "build_tiny", slow_quick_build)
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: resolve_model_path(ModelConfig(path="tiny"), "arith"), range(2)))
    assert paths[0] == paths[1] and len(builds) == 1


def test_response_logits_skips_all_pad_columns_and_keeps_real_token_logits(tiny_dir: Path) -> None:
    """Trimmed forward (shared left padding, response tail) == the full padded forward on real tokens."""
    from engine.batch import Batch
    from engine.workers.policy import response_logits

    model, tokenizer = load_model_and_tokenizer(ModelConfig(path=str(tiny_dir)))
    enc = encode_prompts(tokenizer, [[{"role": "user", "content": "12+3="}], [{"role": "user", "content": "1+2="}]])
    pad = tokenizer.pad_token_id
    # Two extra left-pad columns in every row, responses of 3 and 1 tokens padded to 6.
    prompt_ids = torch.cat([torch.full((2, 2), pad), enc.input_ids], 1)
    prompt_mask = torch.cat([torch.zeros(2, 2, dtype=torch.long), enc.attention_mask], 1)
    responses = torch.tensor([[5, 6, 7, pad, pad, pad], [8, pad, pad, pad, pad, pad]])
    response_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    batch = Batch({"input_ids": torch.cat([prompt_ids, responses], 1),
                   "attention_mask": torch.cat([prompt_mask, response_mask], 1),
                   "responses": responses, "response_mask": response_mask}, {})
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    with torch.no_grad():
        trimmed = response_logits(model, batch, 1.0, "padded")
    hook.remove()
    assert trimmed.shape == (2, 6, len(tokenizer)) and seen == [enc.input_ids.shape[1] + 3]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    full = full[:, -7:-1]
    real = response_mask.bool()
    assert float((trimmed - full)[real].abs().max()) <= 1e-5
    assert bool((trimmed[~real.any(0).expand(2, -1)] == 0).all())  # past the longest response: zeros


def test_shared_prompt_forward_equals_the_padded_forward_with_gradients(tiny_dir: Path) -> None:
    """Rows with the same prompt share one prompt pass (its KV cache repeated per row): the same logits
    and the same gradients as one padded forward of every row."""
    from engine.batch import Batch
    from engine.workers.policy import response_logits

    model, tokenizer = load_model_and_tokenizer(ModelConfig(path=str(tiny_dir)))
    texts = ["12+3=", "1+2=", "123+45="]
    enc = encode_prompts(tokenizer, [[{"role": "user", "content": t}] for t in texts])
    which = [0, 1, 0, 2, 1, 0, 1]  # 3 distinct prompts over 7 rows, in mixed order
    pad = tokenizer.pad_token_id
    lengths = [3, 1, 5, 2, 4, 1, 5]
    responses = torch.full((7, 6), pad)
    for i, n in enumerate(lengths):
        responses[i, :n] = torch.randint(3, 20, (n,), generator=torch.Generator().manual_seed(i))
    response_mask = (torch.arange(6)[None] < torch.tensor(lengths)[:, None]).long()
    batch = Batch({"input_ids": torch.cat([enc.input_ids[which], responses], 1),
                   "attention_mask": torch.cat([enc.attention_mask[which], response_mask], 1),
                   "responses": responses, "response_mask": response_mask}, {})
    model.train()
    results = {}
    for share in (False, True):
        seen: list[tuple[int, int]] = []
        hook = model.register_forward_pre_hook(lambda _m, _a, kw, seen=seen: seen.append(tuple(kw["input_ids"].shape)),
                                               with_kwargs=True)
        model.zero_grad()
        logits = response_logits(model, batch, 0.7, "shared" if share else "padded")
        (logits.logsumexp(-1) * response_mask).sum().backward()
        hook.remove()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[share] = (logits.detach(), grads, seen)
    (plain, plain_grads, plain_seen), (shared, shared_grads, shared_seen) = results[False], results[True]
    assert len(plain_seen) == 1 and plain_seen[0][0] == 7
    assert [s[0] for s in shared_seen] == [3, 7]  # each prompt once, then the 7 responses on its cache
    assert shared_seen[1][1] == max(lengths) - 1
    real = response_mask.bool()
    assert float((shared - plain)[real].abs().max()) <= 1e-5
    assert bool((shared[~real.any(0).expand(7, -1)] == 0).all())
    assert plain_grads.keys() == shared_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-5)


def test_shared_prompt_forward_runs_two_passes_whatever_the_data(tiny_dir: Path) -> None:
    """No repeated prompt, and every response one token long: still a prompt pass and a response pass
    (under FSDP2 each forward all-gathers, so the count must not depend on the data), both in the
    backward's graph, with the padded forward's logits and gradients."""
    from engine.batch import Batch
    from engine.workers.policy import response_logits

    model, tokenizer = load_model_and_tokenizer(ModelConfig(path=str(tiny_dir)))
    enc = encode_prompts(tokenizer, [[{"role": "user", "content": t}] for t in ("12+3=", "1+2=", "123+45=")])
    responses = torch.tensor([[5, 0, 0], [6, 0, 0], [7, 0, 0]])
    response_mask = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 0, 0]])
    batch = Batch({"input_ids": torch.cat([enc.input_ids, responses], 1),
                   "attention_mask": torch.cat([enc.attention_mask, response_mask], 1),
                   "responses": responses, "response_mask": response_mask}, {})
    seen: list[tuple[int, int]] = []
    calls: list[str] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    bwd = model.model.layers[0].register_full_backward_hook(lambda *_: calls.append("backward"))
    results = {}
    for share in (False, True):
        model.zero_grad()
        logits = response_logits(model, batch, 1.0, "shared" if share else "padded")
        (logits.logsumexp(-1) * response_mask.unsqueeze(-1)).sum().backward()
        results[share] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    hook.remove()
    bwd.remove()
    assert seen[1:] == [(3, enc.input_ids.shape[1]), (3, 1)]  # shared: prompts, then one response column
    assert calls == ["backward"] * 3  # the padded forward's once, the shared forwards' twice
    torch.testing.assert_close(results[True][0], results[False][0], rtol=0, atol=1e-5)
    for name, grad in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], grad, rtol=1e-4, atol=1e-5)


def test_every_layout_reads_a_multi_turn_response_with_its_observations(tiny_dir: Path) -> None:
    """A multi-turn response has holes in its response mask (a tool's observation: read by the model, not
    trained): the shared-prompt and packed forwards attend to them as the padded forward does (the
    shared forward used the response mask as attention: every token after an observation was off)."""
    from engine.batch import Batch
    from engine.workers.policy import response_logits

    model, tokenizer = load_model_and_tokenizer(ModelConfig(path=str(tiny_dir)))
    enc = encode_prompts(tokenizer, [[{"role": "user", "content": t}] for t in ("12+3=", "1+2=")])
    which = [0, 0, 1]
    responses = torch.randint(3, 20, (3, 8), generator=torch.Generator().manual_seed(0))
    # row 0: 2 generated, 3 observation, 2 generated, 1 pad; row 1: no observation; row 2: 1, 2 obs, 4
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]])
    response_mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 1, 1, 1, 1, 0]])
    responses = responses * attention
    batch = Batch({"input_ids": torch.cat([enc.input_ids[which], responses], 1),
                   "attention_mask": torch.cat([enc.attention_mask[which], attention], 1),
                   "responses": responses, "response_mask": response_mask}, {})
    with torch.no_grad():
        padded, shared, packed = (response_logits(model, batch, 1.0, layout) for layout in ("padded", "shared", "packed"))
    trained = response_mask.bool()
    assert float((shared - padded)[trained].abs().max()) <= 1e-5
    assert float((packed - padded)[trained].abs().max()) <= 1e-5


def test_length_order_keeps_prompt_groups_together() -> None:
    from engine.batch import Batch
    from engine.workers.fsdp import length_order

    prompts = torch.tensor([[1, 2], [3, 4], [1, 2], [3, 4], [5, 6], [1, 2]])
    lengths = torch.tensor([4, 1, 2, 3, 2, 1])
    mask = (torch.arange(5)[None] < lengths[:, None]).long()
    batch = Batch({"input_ids": torch.cat([prompts, torch.zeros(6, 5, dtype=torch.long)], 1),
                   "attention_mask": torch.cat([torch.ones(6, 2, dtype=torch.long), mask], 1),
                   "responses": torch.zeros(6, 5, dtype=torch.long), "response_mask": mask}, {})
    # groups: [5,6] longest 2, [3,4] longest 3, [1,2] longest 4; within a group shortest first
    assert length_order(batch, group_prompts=True).tolist() == [4, 1, 3, 5, 2, 0]
    assert length_order(batch, group_prompts=False).tolist() == [1, 5, 2, 4, 3, 0]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_models_load_without_dropout_and_train_mode_is_repeatable(tmp_path: Path, family: str) -> None:
    """GPT-2's resid/embd/attn pdrop 0.1 and Llama's attention_dropout 0.1 in the config, and the value
    head's default classifier dropout 0.1: every model the engine loads drops nothing."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from engine.models.loading import dropout_left, load_value_model

    if family == "gpt2":
        GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=40, n_positions=32,
                                   bos_token_id=0, eos_token_id=0)).save_pretrained(tmp_path)
    else:
        LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=2, vocab_size=40, attention_dropout=0.1)).save_pretrained(tmp_path)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    for loader in (load_model, load_value_model):
        model = loader(str(tmp_path))
        assert dropout_left(model) == []
        model.train()
        torch.testing.assert_close(model(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    from transformers import AutoModelForTokenClassification

    plain = AutoModelForTokenClassification.from_pretrained(tmp_path, num_labels=1).train()
    assert dropout_left(plain)  # what the check would catch without our loader
