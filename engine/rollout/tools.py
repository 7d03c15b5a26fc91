"""Tools for multi-turn rollouts: declaration, the family's tool-call format, argument checks, and the
sandboxed call that turns any outcome into an observation the model reads.

    @tool(description="evaluate an arithmetic expression",
          parameters={"type": "object", "properties": {"expression": {"type": "string"}},
                      "required": ["expression"]})
    def calc(expression: str) -> str: ...

`rollout.multi_turn.tools=[FILE.py:calc]` registers it. A turn of the model that ends with a tool call
in the format of its family (`rollout.multi_turn.format`) is parsed from the text; the call's arguments
are checked against the declared JSON schema; the tool runs in the reward sandbox (a child process with
a wall-clock timeout and an address-space cap). Whatever happens — a malformed call, an unknown tool,
arguments that do not fit, a tool that raises, hangs, runs out of memory or returns something that is
not text — the model gets an observation saying so, and the rollout goes on. Nothing a tool does fails
the rollout; only a sandbox that cannot start at all (a broken environment) does.

Formats:
- hermes (Qwen2 / Qwen2.5 / Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- llama3_json (Llama 3.1 / 3.2 JSON tool calling): the turn is `{"name": ..., "parameters": {...}}`
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from engine.errors import ConfigError
from engine.imports import canonical_spec, load_object
from engine.rewards.sandbox import SandboxJob, bwrap_available, run_sandboxed, shown_files
from engine.rewards.types import SandboxLimits

Format = Literal["hermes", "llama3_json"]
FORMATS: tuple[str, ...] = ("hermes", "llama3_json")
# The text that closes a tool call (where a turn is cut; llama3_json's turn ends at the model's end-of-turn
# token), and hermes' own wrapping of an observation, for a chat template without a tool turn.
CALL_END = {"hermes": "</tool_call>", "llama3_json": None}
OBSERVATION = {"hermes": "\n<tool_response>\n{}\n</tool_response>\n"}
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                            "boolean": (bool,), "array": (list,), "object": (dict,)}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of an object
    pure: bool = False  # computes from its arguments only (no files, processes, network): runs without bwrap


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def tool(*, parameters: dict[str, Any], description: str = "", name: str | None = None,
         pure: bool = False) -> Callable[[Any], Any]:
    """Declare a function as a tool: its name, a description and the JSON schema of its arguments.
    `pure`: it computes from its arguments only; where bubblewrap is missing, only a pure tool runs
    (unless reward.sandbox.isolation=none)."""
    if parameters.get("type") != "object":
        raise ConfigError(f"a tool's parameters are the JSON schema of an object (type: object), got {parameters!r}")

    def wrap(fn: Any) -> Any:
        fn.rlflow_tool = ToolSpec(name or fn.__name__, description or (fn.__doc__ or "").strip(), parameters, pure)
        return fn
    return wrap


def load_tools(refs: Sequence[str]) -> dict[str, tuple[str, ToolSpec]]:
    """{tool name: (its 'module:function' or 'file.py:function', its spec)}; ConfigError for a function
    that is not a declared tool, or two tools of one name."""
    found: dict[str, tuple[str, ToolSpec]] = {}
    for ref in map(canonical_spec, refs):
        fn = load_object(ref, "rollout.multi_turn.tools", ConfigError)
        spec = getattr(fn, "rlflow_tool", None)
        if not isinstance(spec, ToolSpec):
            raise ConfigError(f"rollout.multi_turn.tools: {ref} is not a tool; declare it with "
                              "@engine.rollout.tools.tool(parameters={...JSON schema...})")
        if spec.name in found:
            raise ConfigError(f"rollout.multi_turn.tools: two tools are named {spec.name!r} ({found[spec.name][0]}, {ref})")
        found[spec.name] = (ref, spec)
    return found


def parse_tool_call(text: str, fmt: Format) -> ToolCall | str | None:
    """The tool call a turn ends with: a ToolCall, an error message (a call that does not parse), or None
    (the turn is an answer, not a call)."""
    if fmt == "hermes":
        found = _HERMES.findall(text)
        if not found:
            return "a <tool_call> without its closing </tool_call>" if "<tool_call>" in text else None
        body, key = found[-1], "arguments"
    else:
        body, key = text.strip(), "parameters"
        if not body.startswith("{"):
            return None
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return f"the tool call is not JSON: {err.msg} at character {err.pos}"
    except RecursionError:
        return f"the tool call is nested deeper than {MAX_DEPTH} levels"
    except ValueError as err:  # an integer past Python's digit limit
        return f"the tool call is not JSON: {str(err).splitlines()[0][:120]}"
    if _deeper_than(call, MAX_DEPTH):
        return f"the tool call is nested deeper than {MAX_DEPTH} levels"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return 'the tool call needs a "name" (a string)'
    try:
        json.dumps(call, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return "the tool call holds a \\u escape that is not a character (a lone surrogate)"
    arguments = call.get(key, {})
    if not isinstance(arguments, dict):
        return f'the tool call\'s "{key}" must be an object'
    return ToolCall(call["name"], arguments)


MAX_DEPTH = 64  # nesting of a call's JSON: deeper is refused before anything walks it recursively


def _deeper_than(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def check_arguments(arguments: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """Why `arguments` do not fit the schema (required keys, declared types, no undeclared keys when
    additionalProperties is false), or None."""
    properties = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}"
    for key, value in arguments.items():
        if key not in properties:
            if schema.get("additionalProperties", True) is False:
                return f"unknown argument {key!r}; allowed: {', '.join(properties)}"
            continue
        kind = properties[key].get("type")
        allowed = _JSON_TYPES.get(kind, (object,)) if isinstance(kind, str) else (object,)
        if not isinstance(value, allowed) or (kind in ("integer", "number") and isinstance(value, bool)):
            return f"argument {key!r} must be {kind}, got {type(value).__name__}"
    return None


# The job a sandbox child runs for one call: import the tool (by module or file path, without importing
# rlflow), call it, and mark a result that is not text (the parent turns it into an observation).
_CALL = """
import importlib, importlib.util, sys
target, _, attr = REF.rpartition(":")
if target.endswith(".py"):
    module = sys.modules.get(target)
    if module is None:
        spec = importlib.util.spec_from_file_location("rlflow_tool_" + str(abs(hash(target))), target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[target] = module
else:
    module = importlib.import_module(target)
value = getattr(module, attr)(**ARGS)
result = value if isinstance(value, str) else {"not_text": type(value).__name__}
"""


def call_tools(calls: Sequence[tuple[str, ToolCall] | str], tools: dict[str, tuple[str, ToolSpec]],
               limits: SandboxLimits, max_chars: int) -> list[str]:
    """One observation per entry: an entry is (row label, the call) or an error message from parsing.
    The valid calls run one after another in sandbox children (one child for all, a new one after a hang)."""
    out: list[str | None] = []
    jobs: list[SandboxJob] = []
    where: list[tuple[int, str]] = []
    runs_all = limits.isolation == "none" or bwrap_available()
    if not runs_all:  # no bubblewrap here: only pure tools run, outside it
        limits = replace(limits, isolation="none")
    for entry in calls:
        if isinstance(entry, str):
            out.append(f"error: {entry}")
            continue
        _, call = entry
        if call.name not in tools:
            out.append(f"error: no tool named {call.name!r}; tools: {', '.join(tools)}")
            continue
        ref, spec = tools[call.name]
        problem = check_arguments(call.arguments, spec.parameters)
        if problem is not None:
            out.append(f"error: {call.name}: {problem}")
            continue
        if not runs_all and not spec.pure:
            out.append(f"error: {call.name} runs only in the sandbox, and bubblewrap (bwrap) is not installed")
            continue
        # JSON text into the job as a string literal, decoded there: true, null and Infinity become the
        # Python values JSON means (written as code, they were names the job did not know)
        code = f"import json\nREF = {ref!r}\nARGS = json.loads({json.dumps(call.arguments)!r})\n" + _CALL
        where.append((len(out), call.name))
        jobs.append(SandboxJob(code=code, mode="exec", builtins=True))
        out.append(None)
    files = sorted({path for ref, _ in tools.values() for path in shown_files(ref)})  # each tool's own code
    for (i, name), result in zip(where, run_sandboxed(jobs, limits, files) if jobs else []):
        out[i] = _observation(name, result, limits)
    return [(text or "")[:max_chars] for text in out]


def _observation(name: str, result: Any, limits: SandboxLimits) -> str:
    if result.status == "ok":
        if isinstance(result.value, str):
            return result.value
        kind = result.value.get("not_text") if isinstance(result.value, dict) else type(result.value).__name__
        return f"error: {name} returned {kind}, not text"
    if result.status == "timeout":
        return f"error: {name} ran over its {limits.timeout_s:g} s (rollout.multi_turn.tool_timeout_s)"
    if result.status == "memory":
        return f"error: {name} ran out of memory ({limits.memory_mb} MB, rollout.multi_turn.tool_memory_mb)"
    return f"error: {name} failed: {result.detail or result.status}"


def observation_text(fmt: Format, observation: str) -> str:
    """The observation in the format's own wrapping: what follows a call when the model's chat template has
    no tool turn of its own (see `observation_renderer`)."""
    return OBSERVATION[fmt].format(observation)


@dataclass(frozen=True)
class ToolTurn:
    """Where the chat template puts a tool's answer after an assistant turn: `end` is the text it writes
    after an assistant message's content (the end of that turn), `before` and `after` wrap the tool
    message's content up to the next assistant turn's header. Read from the template itself."""

    end: str
    before: str
    after: str


_ASSISTANT, _TOOL, _OTHER = "\x01rlflow-assistant\x01", "\x01rlflow-tool\x01", "rlflowotherrole"


def tool_turn(tokenizer: Any) -> ToolTurn | None:
    """How the tokenizer's chat template renders a tool message after an assistant message, or None when it
    renders none of its own: no template, a template that fails or drops the message, or a generic one that
    writes any role the same way (`<|tool|>...` as `<|anything|>...`)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _ASSISTANT}]

    def render(role: str) -> str:
        return str(tokenizer.apply_chat_template(base + [{"role": role, "content": _TOOL}], tokenize=False,
                                                 add_generation_prompt=True))

    try:
        plain = str(tokenizer.apply_chat_template(base, tokenize=False))
        full, other = render("tool"), render(_OTHER)
    except Exception:  # noqa: BLE001 - a template that cannot render a tool message has no tool turn
        return None
    if _ASSISTANT not in plain or not full.startswith(plain) or _TOOL not in full[len(plain):]:
        return None
    if other.replace(_OTHER, "tool") == full:  # the role's name is all that differs: no tool turn of its own
        return None
    before, after = full[len(plain):].split(_TOOL, 1)
    return ToolTurn(end=plain[plain.index(_ASSISTANT) + len(_ASSISTANT):], before=before, after=after)


def observation_renderer(tokenizer: Any, fmt: Format) -> Callable[[str, str], str]:
    """fn(turn_end, observation) -> the text the model reads after a turn that ended with a call.
    `turn_end`: the text of the turn's last token when it is a stop token the model generated, else "".

    Through the model's chat template where it renders a tool turn (Qwen2.5's `<|im_start|>user
    <tool_response>...`, Llama 3.1's `ipython` header): the end of the assistant turn the model did not
    write itself, the tool turn, and the next assistant header, as the template writes a conversation.
    Otherwise hermes' own wrapping; llama3_json has none and is refused."""
    turn = tool_turn(tokenizer)
    if turn is None:
        if fmt == "llama3_json":
            raise ConfigError("rollout.multi_turn.format=llama3_json needs a chat template that renders a tool "
                              "message (Llama 3.1's writes it as an ipython turn); this model's does not")
        return lambda turn_end, observation: observation_text(fmt, observation)

    def render(turn_end: str, observation: str) -> str:
        if not turn_end:  # cut at the call: the template's end of the turn is still to come
            end = turn.end
        elif turn.end.startswith(turn_end):  # the model wrote the template's end-of-turn token itself
            end = turn.end[len(turn_end):]
        else:  # another stop token of the model's (Llama's <|eom_id|> for <|eot_id|>) stands for it
            end = ""
        return end + turn.before + observation + turn.after

    return render


def describe(tools: dict[str, tuple[str, ToolSpec]]) -> list[dict[str, Any]]:
    """The tools as a chat template's `tools=` argument (OpenAI's function schema)."""
    return [{"type": "function", "function": {"name": s.name, "description": s.description,
                                              "parameters": s.parameters}} for _, s in tools.values()]
