"""Tiny random models of the Hub's common causal-LM families, each with a byte-level BPE tokenizer trained
here on the task's text and its family's own chat template and special tokens.

No hub is reachable here, so what users bring (Qwen, Llama, Mistral, Gemma, Phi, GPT-2 checkpoints) is
stood in for by models of the same `transformers` architectures, built locally and deterministically:

    build_family("qwen2", "out/qwen2", task="sort", seed=0)      # rlflow model make-tiny OUT --family qwen2

The special tokens, which token ends a turn, whether the generation config lists several stop tokens,
whether the tokenizer has a pad token at all, and whether the embeddings are tied follow each family's
released instruct checkpoints, because that is what the engine must get right:

| family  | architecture        | chat format                          | eos (generation stops)        | pad             | tied |
|---------|---------------------|--------------------------------------|-------------------------------|-----------------|------|
| llama   | LlamaForCausalLM    | Llama 3.1 headers, <|eot_id|>, tools | <|eot_id|>, <|end_of_text|>   | none (eos used) | no   |
| qwen2   | Qwen2ForCausalLM    | Qwen2.5's ChatML, tools              | <|im_end|>, <|endoftext|>     | <|endoftext|>   | yes  |
| qwen3   | Qwen3ForCausalLM    | ChatML                               | <|im_end|>, <|endoftext|>     | <|endoftext|>   | yes  |
| mistral | MistralForCausalLM  | [INST] ... [/INST]                   | </s>                          | none (eos used) | no   |
| gemma   | Gemma2ForCausalLM   | <start_of_turn>user/model            | <end_of_turn>, <eos>          | <pad>           | yes  |
| phi3    | Phi3ForCausalLM     | <|user|> ... <|end|> <|assistant|>   | <|end|>, <|endoftext|>        | <|endoftext|>   | no   |
| gpt2    | GPT2LMHeadModel     | none (plain text)                    | <|endoftext|>                 | none (eos used) | yes  |
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

from engine.demo.folders import empty_target, into_place
from engine.demo.synthetic import TASKS, make_rows, solution_text
from engine.errors import ConfigError

VOCAB_SIZE = 512  # BPE merges learned on the task's text; the byte alphabet (256) is always in


@dataclass(frozen=True)
class FamilyShape:
    """The size of a family's tiny model (small enough for a 2-iteration pipeline test per family)."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str  # transformers' config model_type
    specials: dict[str, str | None]  # bos, eos, pad, unk: the tokenizer's
    extra_tokens: tuple[str, ...]  # the chat format's own special tokens
    generation_eos: tuple[str, ...]  # what ends generation (generation_config.eos_token_id)
    tie_word_embeddings: bool
    chat_template: str | None
    config: dict[str, Any] = field(default_factory=dict)  # family-specific config fields


CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' and default_system -%}"
    "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Written here to render as the published instruct templates do, tool turns included (Qwen2.5: tool answers
# inside a user turn as <tool_response> blocks, consecutive ones in one turn, the assistant's calls as
# <tool_call> blocks, the tools listed in the system turn; Llama 3.1: a system header with its knowledge
# date, tool answers as an `ipython` turn, a call as the turn's JSON {"name", "parameters"}).
QWEN25_TEMPLATE = (
    "{%- set default_system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' -%}"
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else default_system -%}"
    "{{- '<|im_start|>system\\n' + system -}}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' and loop.first -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif m['role'] == 'assistant' and m.get('tool_calls') -%}"
    "{{- '<|im_start|>assistant' -}}{%- if m['content'] -%}{{- '\\n' + m['content'] -}}{%- endif -%}"
    "{%- for c in m['tool_calls'] -%}{%- set f = c['function'] if c['function'] is defined else c -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' + (f['arguments'] | tojson) "
    "+ '}\\n</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
LLAMA31_TEMPLATE = (
    "{{- bos_token -}}{%- set ns = namespace(first_user=true) -%}"
    "{%- set system = messages[0]['content'] | trim if messages and messages[0]['role'] == 'system' else '' -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' -}}"
    "{%- if tools -%}{{- 'Environment: ipython\\n' -}}{%- endif -%}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' + system + '<|eot_id|>' -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' and loop.first -%}"
    "{%- elif m['role'] in ('tool', 'ipython') -%}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' -}}"
    "{%- if m['content'] is mapping or (m['content'] is iterable and m['content'] is not string) -%}"
    "{{- m['content'] | tojson -}}{%- else -%}{{- m['content'] -}}{%- endif -%}{{- '<|eot_id|>' -}}"
    "{%- elif m['role'] == 'assistant' and m.get('tool_calls') -%}"
    "{%- set c = m['tool_calls'][0] -%}{%- set f = c['function'] if c['function'] is defined else c -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + f['name'] + '\", \"parameters\": ' "
    "+ (f['arguments'] | tojson) + '}<|eot_id|>' -}}"
    "{%- elif tools and m['role'] == 'user' and ns.first_user -%}{%- set ns.first_user = false -%}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON "
    "for a function call with its proper arguments that best answers the given prompt.\\n\\nRespond in the format "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}. Do not use variables."
    "\\n\\n' -}}"
    "{%- for t in tools -%}{{- (t | tojson(indent=4)) + '\\n\\n' -}}{%- endfor -%}"
    "{{- m['content'] | trim + '<|eot_id|>' -}}"
    "{%- else -%}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
MISTRAL_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{- '[INST] ' + m['content'] + ' [/INST]' -}}"
    "{%- elif m['role'] == 'assistant' -%}{{- m['content'] + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)
GEMMA_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
PHI3_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- else -%}{{- eos_token -}}{%- endif -%}"
)

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "llama", {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": None, "unk": None},
           ("<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>"), ("<|eot_id|>", "<|end_of_text|>"),
           False, LLAMA31_TEMPLATE),
    Family("qwen2", "qwen2", {"bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "unk": None},
           ("<|im_start|>",), ("<|im_end|>", "<|endoftext|>"), True,
           QWEN25_TEMPLATE),
    Family("qwen3", "qwen3", {"bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "unk": None},
           ("<|im_start|>",), ("<|im_end|>", "<|endoftext|>"), True,
           CHATML_TEMPLATE.replace("default_system", "''"), {"head_dim": 16}),
    Family("mistral", "mistral", {"bos": "<s>", "eos": "</s>", "pad": None, "unk": "<unk>"},
           ("[INST]", "[/INST]"), ("</s>",), False, MISTRAL_TEMPLATE),
    Family("gemma", "gemma2", {"bos": "<bos>", "eos": "<eos>", "pad": "<pad>", "unk": "<unk>"},
           ("<start_of_turn>", "<end_of_turn>"), ("<end_of_turn>", "<eos>"), True, GEMMA_TEMPLATE,
           {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 64}),
    Family("phi3", "phi3", {"bos": "<s>", "eos": "<|endoftext|>", "pad": "<|endoftext|>", "unk": "<unk>"},
           ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>"), ("<|end|>", "<|endoftext|>"), False,
           PHI3_TEMPLATE),
    Family("gpt2", "gpt2", {"bos": "<|endoftext|>", "eos": "<|endoftext|>", "pad": None, "unk": None},
           (), ("<|endoftext|>",), True, None),
)}


def task_corpus(task: str, seed: int, rows: int = 2000) -> list[str]:
    """The text the tokenizer learns from: the task's prompts and solutions."""
    out = []
    for row in make_rows(task, rows, seed=seed):
        prompt = row["prompt"]
        out.append(prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt))
        out.append(solution_text(row))
    return out


def build_tokenizer(family: Family, corpus: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2's scheme: no unknown byte) trained on `corpus`, with the family's specials."""
    specials = [t for t in (*family.specials.values(), *family.extra_tokens) if t is not None]
    specials = list(dict.fromkeys(specials))
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus, trainer=trainer)
    names = {"bos": "bos_token", "eos": "eos_token", "pad": "pad_token", "unk": "unk_token"}
    kwargs = {names[k]: v for k, v in family.specials.items() if v is not None}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, chat_template=family.chat_template,
                                        additional_special_tokens=list(family.extra_tokens), **kwargs)
    tokenizer.add_bos_token = family.specials["bos"] is not None and family.name != "gpt2"
    return tokenizer


def build_family(name: str, out_dir: str | Path, task: str = "sort", seed: int = 0,
                 shape: FamilyShape = FamilyShape()) -> Path:
    """Build family `name`'s tiny random model and tokenizer for `task` into `out_dir` (new or empty),
    deterministically: the same (family, task, seed) gives the same files."""
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; allowed: {', '.join(FAMILIES)}")
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
    family = FAMILIES[name]
    out = empty_target(out_dir)
    tokenizer = build_tokenizer(family, task_corpus(task, seed))
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in family.specials.items() if v is not None}
    config = AutoConfig.for_model(family.model_type, **_shape_kwargs(family, shape), vocab_size=len(tokenizer),
                                  bos_token_id=ids.get("bos"), eos_token_id=ids["eos"], pad_token_id=ids.get("pad"),
                                  tie_word_embeddings=family.tie_word_embeddings, **family.config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        bos_token_id=ids.get("bos"), pad_token_id=ids.get("pad", ids["eos"]),
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in family.generation_eos])
    with into_place(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "rlflow_family.json").write_text(json.dumps({"family": name, "task": task, "seed": seed,
                                                            "num_parameters": model.num_parameters()}))
    return out


def _shape_kwargs(family: Family, shape: FamilyShape) -> dict[str, Any]:
    if family.model_type == "gpt2":  # GPT-2 names its sizes its own way
        return {"n_embd": shape.hidden_size, "n_inner": shape.intermediate_size, "n_layer": shape.num_hidden_layers,
                "n_head": shape.num_attention_heads, "n_positions": shape.max_position_embeddings}
    return {"hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
            "num_hidden_layers": shape.num_hidden_layers, "num_attention_heads": shape.num_attention_heads,
            "num_key_value_heads": shape.num_key_value_heads,
            "max_position_embeddings": shape.max_position_embeddings}
