"""Tools of multi-turn rollouts: the tool-call formats parsed from text, argument checks against the
declared schema, and every way a tool can go wrong becoming an observation (nothing raised)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.rewards.types import SandboxLimits
from engine.rollout.builtin_tools import calculator
from engine.rollout.tools import ToolCall, call_tools, check_arguments, load_tools, parse_tool_call

TOOLS = Path(__file__).resolve().parents[1] / "pipeline" / "tools.py"


def test_hermes_and_llama3_calls_are_parsed_from_text() -> None:
    text = 'let me compute <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
    assert parse_tool_call(text, "hermes") == ToolCall("calculator", {"expression": "2+3"})
    assert parse_tool_call("#### 5", "hermes") is None
    assert parse_tool_call("<tool_call>{oops}</tool_call>", "hermes").startswith("the tool call is not JSON")
    assert parse_tool_call('<tool_call>{"arguments": {}}</tool_call>', "hermes") == 'the tool call needs a "name" (a string)'
    assert parse_tool_call('{"name": "calculator", "parameters": {"expression": "1"}}', "llama3_json") == \
        ToolCall("calculator", {"expression": "1"})
    assert parse_tool_call("The answer is 5", "llama3_json") is None


def test_arguments_are_checked_against_the_schema() -> None:
    schema = {"type": "object", "properties": {"expression": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["expression"], "additionalProperties": False}
    assert check_arguments({"expression": "1"}, schema) is None
    assert check_arguments({}, schema) == "missing required argument(s) expression"
    assert check_arguments({"expression": 1}, schema) == "argument 'expression' must be string, got int"
    assert check_arguments({"expression": "1", "n": True}, schema) == "argument 'n' must be integer, got bool"
    assert check_arguments({"expression": "1", "x": 2}, schema) == "unknown argument 'x'; allowed: expression, n"


def test_a_function_not_declared_as_a_tool_is_refused() -> None:
    with pytest.raises(ConfigError, match="undeclared is not a tool; declare it with @engine.rollout.tools.tool"):
        load_tools([f"{TOOLS}:undeclared"])


def test_every_failure_of_a_tool_is_an_observation() -> None:
    tools = load_tools([f"{TOOLS}:{name}" for name in ("echo", "boom", "slow", "hog", "number")]
                       + ["engine.rollout.builtin_tools:calculator"])
    calls = [("0", ToolCall("echo", {"text": "abc"})), ("1", ToolCall("boom", {})), ("2", ToolCall("slow", {})),
             ("3", ToolCall("hog", {})), ("4", ToolCall("number", {})), ("5", ToolCall("nope", {})),
             ("6", ToolCall("echo", {"text": 3})), "the tool call is not JSON: x",
             ("8", ToolCall("calculator", {"expression": "1234+5678"})), ("9", ToolCall("echo", {"text": "z" * 50}))]
    start = time.monotonic()
    got = call_tools(calls, tools, SandboxLimits(timeout_s=2.0, memory_mb=256), max_chars=30)
    assert time.monotonic() - start < 30  # the hang cost its timeout, not 600 s
    assert got == [
        "cba",
        "error: boom failed: RuntimeErr",  # the exception, cut at max_chars
        "error: slow ran over its 2 s (",
        "error: hog ran out of memory (",
        "error: number returned int, no",
        "error: no tool named 'nope'; t",
        "error: echo: argument 'text' m",
        "error: the tool call is not JS",
        "6912",
        "z" * 30,
    ]
    full = call_tools(calls[1:5], tools, SandboxLimits(timeout_s=2.0, memory_mb=256), max_chars=300)
    assert full == ["error: boom failed: RuntimeError: the tool broke",
                    "error: slow ran over its 2 s (rollout.multi_turn.tool_timeout_s)",
                    "error: hog ran out of memory (256 MB, rollout.multi_turn.tool_memory_mb)",
                    "error: number returned int, not text"]


def test_calculator() -> None:
    assert calculator("1234+5678") == "6912"
    assert calculator("(2+3)*4-7//2%3") == str((2 + 3) * 4 - 7 // 2 % 3)
    assert calculator("__import__('os')").startswith("error: only integers")
    assert calculator("1+").startswith("error: not an expression")


def test_the_tools_reach_a_chat_template_that_renders_them() -> None:
    from engine.demo.tiny import build_tokenizer
    from engine.models.tokens import encode_prompts, prompt_lengths, prompt_text
    from engine.rollout.tools import describe

    tokenizer = build_tokenizer()
    tokenizer.chat_template = ("{% if tools %}{% for t in tools %}[{{ t.function.name }}: {{ t.function.description }}]"
                               "{% endfor %}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    tools = describe(load_tools(["engine.rollout.builtin_tools:calculator"]))
    messages = [{"role": "user", "content": "1+2="}]
    assert prompt_text(tokenizer, messages, tools) == \
        "[calculator: evaluate an integer arithmetic expression (+ - * // %, parentheses)]1+2="
    assert prompt_text(tokenizer, messages) == "1+2="
    assert prompt_lengths(tokenizer, [messages], tools)[0] == len(prompt_text(tokenizer, messages, tools))
    assert encode_prompts(tokenizer, [messages], tools=tools).input_ids.shape[1] == prompt_lengths(tokenizer, [messages], tools)[0]


ADVERSARIAL = [
    "[" * 100_000,  # nesting past the recursion limit
    '{"name": "echo", "arguments": {"text": ' + "[" * 50_000 + "]" * 50_000 + "}}",
    '{"name": "echo", "arguments": {"n": ' + "9" * 4_301 + "}}",  # past int's digit limit
    '{"name": "echo", "arguments": {"text": "\\ud800"}}',  # a lone surrogate escape
    '{"name": "echo", "arguments": {"text": "\\u12"}}',  # a truncated escape
    '{"name": "echo", "arguments": {"text": "abc',  # truncated
    '{"name": "echo", "arguments": NaN}', '{"name": 1e999}', '{"name": "echo", "arguments": [true, null]}',
    "\x00\xff\ufeff{", "<tool_call>", "<tool_call></tool_call>", "<tool_call>" * 1000 + "</tool_call>",
]


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_model_output_never_raises_in_the_parser(fmt: str) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    def wrapped(body: str) -> str:
        return f"<tool_call>{body}</tool_call>" if fmt == "hermes" else body

    for body in ADVERSARIAL:
        assert isinstance(parse_tool_call(wrapped(body), fmt), (ToolCall, str, type(None))), body
    json_text = st.recursive(
        st.sampled_from(["true", "false", "null", "NaN", "Infinity", "-Infinity", "0", "-0.0", "1e999",
                         "9" * 5000, '"\\ud800"', '"\\u00"', '""', '"a"']),
        lambda inner: st.one_of(st.lists(inner).map(lambda xs: "[" + ",".join(xs) + "]"),
                                st.dictionaries(st.sampled_from(['"name"', '"arguments"', '"parameters"', '"x"']),
                                                inner).map(lambda d: "{" + ",".join(f"{k}:{v}" for k, v in d.items()) + "}")),
        max_leaves=20)
    alphabet = list('{}[]":,\\ u0123456789eE.+-tnfalsrNI<>/_') + ["\x00", "\ud7ff"]
    noise = st.text(alphabet=st.sampled_from(alphabet), max_size=200)

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.one_of(json_text, noise, st.text(max_size=200)), st.integers(0, 300))
    def never_raises(body: str, cut: int) -> None:
        for text in (wrapped(body), wrapped(body[:cut]), body):
            assert isinstance(parse_tool_call(text, fmt), (ToolCall, str, type(None)))

    never_raises()


def test_json_literals_reach_the_tool_as_the_python_values_json_means() -> None:
    tools = load_tools([f"{TOOLS}:show"])
    text = ('<tool_call>{"name": "show", "arguments": {"a": true, "b": false, "c": null, "d": Infinity, '
            '"e": -Infinity, "f": 1.5, "g": [1, {"h": null}]}}</tool_call>')
    call = parse_tool_call(text, "hermes")
    assert isinstance(call, ToolCall)
    (got,) = call_tools([("0", call)], tools, SandboxLimits(timeout_s=10.0, memory_mb=512), max_chars=1000)
    assert got == repr(sorted({"a": True, "b": False, "c": None, "d": float("inf"), "e": float("-inf"), "f": 1.5,
                               "g": [1, {"h": None}]}.items()))


# -- observations as the model's chat template writes them (issue 28, item 1) -----------------------------
# engine/demo/families.py's qwen2 and llama tokenizers carry templates written to render like the published
# Qwen2.5 and Llama 3.1 ones, tool turns included; qwen3's is a generic ChatML that writes any role alike.

CALL = {"name": "calculator", "arguments": {"expression": "2+3"}}


def _tokenizer(family: str):  # noqa: ANN202
    from engine.demo.families import FAMILIES, build_tokenizer, task_corpus

    return build_tokenizer(FAMILIES[family], task_corpus("sort", 0, rows=50))


def _conversation(answer: str | None = None) -> list[dict]:
    messages = [{"role": "user", "content": "What is 2+3?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
                {"role": "tool", "content": "5"}]
    return messages + ([{"role": "assistant", "content": answer}] if answer is not None else [])


def _call_text(fmt: str) -> str:
    """The call as the model writes it in its turn (before its end-of-turn token)."""
    import json

    if fmt == "hermes":
        return "<tool_call>\n" + json.dumps({"name": CALL["name"], "arguments": CALL["arguments"]}) + "\n</tool_call>"
    return json.dumps({"name": CALL["name"], "parameters": CALL["arguments"]})


@pytest.mark.parametrize(("family", "fmt"), [("qwen2", "hermes"), ("llama", "llama3_json")])
def test_the_observation_is_the_chat_templates_tool_turn(family: str, fmt: str) -> None:
    """The prompt, the model's turn (hermes: cut after </tool_call>; llama3_json: ended by its own
    <|eot_id|>) and the rendered observation are, as text, exactly what the template writes for the
    conversation with the call and the tool's answer, up to the next assistant header."""
    from engine.rollout.tools import observation_renderer

    tok = _tokenizer(family)
    render = observation_renderer(tok, fmt)
    prompt = tok.apply_chat_template(_conversation()[:1], tokenize=False, add_generation_prompt=True)
    turn_end = "" if fmt == "hermes" else "<|eot_id|>"
    written = prompt + _call_text(fmt) + turn_end + render(turn_end, "5")
    assert written == tok.apply_chat_template(_conversation(), tokenize=False, add_generation_prompt=True)


def test_a_template_without_a_tool_turn_gets_hermes_wrapping_and_refuses_llama3_json() -> None:
    from engine.rollout.tools import observation_renderer

    generic = _tokenizer("qwen3")  # ChatML written for any role: `<|im_start|>tool` is not a tool turn
    assert observation_renderer(generic, "hermes")("", "5") == "\n<tool_response>\n5\n</tool_response>\n"
    with pytest.raises(ConfigError, match="llama3_json needs a chat template that renders a tool message"):
        observation_renderer(generic, "llama3_json")


class _Scripted:
    """A rollout backend that writes given turns (each row the same), whatever it is asked."""

    def __init__(self, turns: list[list[int]], stop_ids: list[int], pad: int) -> None:
        self.turns, self.stop_ids, self.pad = list(turns), stop_ids, pad

    def generate(self, input_ids, attention_mask, params, seed):  # noqa: ANN001, ANN201
        import torch

        from engine.rollout.base import RolloutOutput

        turn = self.turns.pop(0)[:params.max_new_tokens]
        rows, width = input_ids.shape[0], params.max_new_tokens
        responses = torch.full((rows, width), self.pad, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        responses[:, :len(turn)] = torch.tensor(turn)
        mask[:, :len(turn)] = 1
        return RolloutOutput(responses, mask, -0.5 * mask.float())


def test_a_llama31_multi_turn_response_is_the_templates_conversation_and_the_reward_reads_all_of_it() -> None:
    """On main each turn kept its <|eot_id|>, the response text stopped at the first one (the reward saw the
    call, not the answer), and the observation was `<|ipython|>...<|eot|>`, which is no Llama 3.1 turn."""
    import torch

    from engine.batch import Batch
    from engine.config import RolloutConfig
    from engine.models.tokens import encode_prompts, response_texts
    from engine.rollout.multi_turn import generate_multi_turn

    tok = _tokenizer("llama")
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rollout = _Scripted([ids(_call_text("llama3_json")) + [eot], ids("#### 5") + [eot]], [eot], tok.pad_token_id or eot)
    cfg = RolloutConfig(max_new_tokens=160, multi_turn={"enable": True, "format": "llama3_json",
                                                        "tools": ["engine.rollout.builtin_tools:calculator"]})
    enc = encode_prompts(tok, [_conversation()[:1]])
    prompts = Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})
    tools = load_tools(cfg.multi_turn.tools)
    out = generate_multi_turn(rollout, tok, tools, prompts, cfg, seed=0, iteration=1, rank=0, do_sample=False,
                              version=0, stage="generate_rollouts", isolation="none")
    real = out["attention_mask"][0, enc.input_ids.shape[1]:].bool()
    whole = tok.decode(enc.input_ids[0][enc.attention_mask[0].bool()].tolist() + out["responses"][0][real].tolist())
    assert whole == tok.apply_chat_template(_conversation("#### 5"), tokenize=False)
    assert int(out["tool_calls"][0]) == 1 and int(out["tool_errors"][0]) == 0
    holes = real & ~out["response_mask"][0].bool()
    assert tok.decode(out["responses"][0][holes].tolist()) == \
        "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    assert torch.equal(out["rollout_logp"][0][holes], torch.zeros(int(holes.sum())))
    (text,) = response_texts(tok, out)
    assert text.startswith(_call_text("llama3_json") + "<|eot_id|>") and text.endswith("#### 5"), text
