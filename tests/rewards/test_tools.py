"""Tools of multi-turn rollouts: the tool-call formats parsed from text, argument checks against the
declared schema, and every way a tool can go wrong becoming an observation (nothing raised)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.builtin_tools import calculator
from engine.errors import ConfigError
from engine.rewards.types import SandboxLimits
from engine.tools import ToolCall, call_tools, check_arguments, load_tools, parse_tool_call

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
    with pytest.raises(ConfigError, match="undeclared is not a tool; declare it with @engine.tools.tool"):
        load_tools([f"{TOOLS}:undeclared"])


def test_every_failure_of_a_tool_is_an_observation() -> None:
    tools = load_tools([f"{TOOLS}:{name}" for name in ("echo", "boom", "slow", "hog", "number")]
                       + ["engine.builtin_tools:calculator"])
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
    from engine.models import encode_prompts, prompt_lengths, prompt_text
    from engine.tiny import build_tokenizer
    from engine.tools import describe

    tokenizer = build_tokenizer()
    tokenizer.chat_template = ("{% if tools %}{% for t in tools %}[{{ t.function.name }}: {{ t.function.description }}]"
                               "{% endfor %}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    tools = describe(load_tools(["engine.builtin_tools:calculator"]))
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
