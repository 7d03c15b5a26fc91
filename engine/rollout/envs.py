"""Text environments for multi-turn rollouts (`rollout.env=module:Class` or `path/to/file.py:Class`), in
the shape of SkyRL-Gym's text environments:

    class GuessNumber:
        def init(self, row: dict) -> list[dict]:            # the episode's prompt messages
            ...
        def step(self, assistant_text: str) -> tuple[list[dict], float, bool, dict]:
            ...                                             # observation messages, reward, done, info

`row` is the prompt row: its `prompt` (messages or text), `data_source`, `ground_truth`, `extra_info`, and a
`seed` derived from the run's seed, the iteration and the row (an environment that draws uses it, so a
replayed rollout plays the same episodes). The class is built with no arguments, once per episode.

Every episode's environment runs in a sandbox child of its own (engine.rewards.sandbox's confinement:
bubblewrap, no network, only the files it needs shown and read-only, a private /tmp, an address-space cap
per process, a pids and a memory cgroup for the episode's processes together): episodes cannot see each
other nor the stack's secrets, and nothing an environment does reaches the trainer but the JSON it returns,
checked here. `init` and each `step` have a deadline (rollout.multi_turn.env_step_timeout_s) from the
moment the request is sent; past it the child is killed and the episode ends as an error. An error of
any kind (a raise, a hang, memory, a crash, a return value of the wrong shape) ends the episode: it is
recorded (its turn says why), counted (`env_errors`), and its reward is rollout.multi_turn.env_error_reward.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from engine.errors import ConfigError, RewardError
from engine.rewards.sandbox import (
    FILE_CAP,
    PROCESS_CAP,
    RESULT_CAP,
    SandboxJob,
    child_cgroups,
    confined,
    kill_child,
    run_sandboxed,
    shown_files,
)
from engine.rewards.types import SandboxLimits

Message = dict[str, str]


class TextEnv:
    """A base an environment may subclass (it need not: any class with these two methods is one)."""

    def init(self, row: dict[str, Any]) -> list[Message]:
        """The episode's prompt: chat messages ({"role": ..., "content": ...})."""
        raise NotImplementedError

    def step(self, assistant_text: str) -> tuple[list[Message], float, bool, dict[str, Any]]:
        """The model's turn (its text, special tokens left out) -> (observation messages, this step's
        reward, whether the episode is over, a JSON-able info dict)."""
        raise NotImplementedError


# The child: import the class (by module or file, without importing rlflow), build it, then answer one
# JSON request a line ({"op": "init", "row": ...} or {"op": "step", "text": ...}) with one JSON line. Its
# own stdout and stderr go to /dev/null (an environment's print cannot garble the answers).
# The class named 'module:Class' or 'path/to/file.py:Class', imported without importing rlflow.
_LOAD_CLASS = """
import importlib, importlib.util

def load_class(ref):
    target, _, attr = ref.rpartition(":")
    if target.endswith(".py"):
        spec = importlib.util.spec_from_file_location("rlflow_env", target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, attr)
"""

# What both children (an environment's, an agent's) start with: their caps, and `answer` / `failure`.
_CHILD_HEAD = r"""
import json, os, resource, sys
ref = sys.argv[1]
cap, fsize, out_cap = (int(a) for a in sys.argv[2:5])
answers = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 1)
os.dup2(null, 2)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

def answer(record):
    try:
        line = json.dumps(record)
    except (TypeError, ValueError) as err:
        line = json.dumps({"status": "error", "detail": "it returned something that is not JSON: %s" % err})
    if len(line) > out_cap:
        line = json.dumps({"status": "error", "detail": "its answer is over %d bytes" % out_cap})
    answers.write(line + "\n")
    answers.flush()

def failure(err):
    if isinstance(err, MemoryError):
        return {"status": "memory", "detail": "MemoryError"}
    try:
        return {"status": "error", "detail": (type(err).__name__ + ": " + str(err))[:300]}
    except BaseException:
        return {"status": "error", "detail": type(err).__name__}
"""

_ENV_CHILD = _LOAD_CLASS + _CHILD_HEAD + r"""
try:
    env = load_class(ref)()
except BaseException as err:
    answer(failure(err))
    sys.exit(0)
answer({"status": "ready"})
for request in sys.stdin.buffer:
    request = json.loads(request)
    try:
        value = env.init(request["row"]) if request["op"] == "init" else env.step(request["text"])
        record = {"status": "ok", "value": value}
    except BaseException as err:
        record = failure(err)
    answer(record)
"""


@dataclass(frozen=True)
class EnvLimits:
    step_timeout_s: float  # init's and each step's wall clock, from the moment the request is sent
    memory_mb: int  # the child's address space
    isolation: str = "bwrap"  # "none": the child runs as this user, unconfined (reward.sandbox.isolation)
    rollout_timeout_s: float | None = None  # all the episodes of one rollout call on a rank, from its start

    def sandbox(self) -> SandboxLimits:
        return SandboxLimits(timeout_s=self.step_timeout_s, memory_mb=self.memory_mb,
                             isolation="none" if self.isolation == "none" else "bwrap")


@dataclass
class StepOutcome:
    """What one call of an episode's environment gave, checked: `error` is why the episode ended badly
    ("" when it did not)."""

    observations: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    error: str = ""


class EnvSession:
    """One episode's environment: a sandbox child of its own, asked one thing at a time."""

    KIND = "environment"
    CHILD = _ENV_CHILD  # the child's program; its arguments: the reference, its caps, then `child_args`

    def __init__(self, ref: str, limits: EnvLimits, readable: Sequence[str] = (), until: float | None = None,
                 child_args: Sequence[str] = ()) -> None:
        """`until`: the rollout's deadline (time.monotonic()); no answer is waited for past it."""
        self.ref, self.limits, self.name, self.until = ref, limits, ref.rpartition(":")[2], until
        command = confined([sys.executable, "-I", "-c", self.CHILD, ref, str(limits.memory_mb * 2**20),
                            str(FILE_CAP), str(RESULT_CAP), *child_args], limits.sandbox(), readable)  # no bwrap: RewardError
        self._stack = contextlib.ExitStack()
        try:
            self._cwd = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="rlflow-env-"))
            self._stderr = self._stack.enter_context(tempfile.TemporaryFile())
            enter = self._stack.enter_context(child_cgroups(PROCESS_CAP, limits.memory_mb))
            self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [*enter, *command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, cwd=self._cwd,
                env={"PATH": os.defpath}, start_new_session=True)
        except OSError as err:
            self._stack.close()
            raise RewardError(f"the environment sandbox could not start {sys.executable}: {err}") from err
        # what comes from the child, with when it came: its output lines (None: its end), and whatever else
        # a subclass puts here (an agent's calls)
        self._lines: queue.Queue[tuple[float, Any]] = queue.Queue()
        assert self._proc.stdout is not None
        self._reader = threading.Thread(target=_pump_timed, args=(self._proc.stdout, self._lines), daemon=True)
        self._reader.start()
        # the interpreter's start, the class's import and its construction: the sandbox's start-up allowance
        # (a cold interpreter on a loaded machine) or the step deadline, whichever is longer
        self._sent, self._allowed = time.monotonic(), max(STARTUP_S, limits.step_timeout_s)
        self.failed = ""  # why the episode ended as an error, once it has

    def send(self, op: str, payload: Any) -> None:
        """Ask for init (payload: the row) or a step (payload: the turn's text); `receive` gets the answer."""
        if self.failed or self._proc is None:
            return
        assert self._proc.stdin is not None
        key = "row" if op == "init" else "text"
        try:
            self._proc.stdin.write(json.dumps({"op": op, key: payload}, default=str).encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the child is gone: the answer it never gives says so
        if op == "step":
            self._sent, self._allowed = time.monotonic(), self.limits.step_timeout_s

    def receive(self, op: str) -> StepOutcome:
        """The answer to the request sent last, checked; an error (and the child killed) past the deadline."""
        if self.failed:
            return StepOutcome(error=self.failed)
        what = f"{self.name}.{op}"
        if op == "init":
            ready = self._answer(f"{self.name}()")
            if ready is None:
                return StepOutcome(error=self.failed)
            if ready.get("status") != "ready":
                return self._fail(f"{self.name} could not be built: {_why(ready)}")
            self._allowed = self.limits.step_timeout_s  # init's own deadline runs from the child being ready
        record = self._answer(what)
        if record is None:
            return StepOutcome(error=self.failed)
        if record.get("status") != "ok":
            return self._fail(f"{what} failed: {_why(record)}")
        problem, outcome = (_check_init if op == "init" else _check_step)(record.get("value"))
        if problem:
            return self._fail(f"{what} returned {problem}")
        return outcome

    def _answer(self, what: str) -> Any:
        """The child's next answer (a JSON object; or what `_event` makes of another item), or None: the
        episode failed (past the deadline, the child ended or wrote garbage)."""
        now = time.monotonic()
        left = self._allowed - (now - self._sent)
        rollout_left = self.until - now if self.until is not None else left
        try:
            at, line = self._lines.get(timeout=max(min(left, rollout_left), 0.0))
        except queue.Empty:
            if rollout_left < left:
                self._fail(f"{what}: the rollout's episodes ran over their {self.limits.rollout_timeout_s:g} s "
                           "(rollout.multi_turn.env_rollout_timeout_s)")
            else:
                self._fail(f"{what} ran over its {self._allowed:g} s (rollout.multi_turn.env_step_timeout_s)")
            return None
        self._sent = max(self._sent, at)  # a next answer (init's, after ready) is timed from this one
        if line is None:
            self._fail(f"{what}: the {self.KIND}'s process ended ({self._stderr_tail()})")
            return None
        if not isinstance(line, bytes):
            return self._event(line)
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            self._fail(f"{what}: the {self.KIND}'s process wrote something that is not an answer")
            return None
        return record

    def _event(self, item: Any) -> Any:
        """What a subclass made of something it put in the queue that is not an output line."""
        raise TypeError(f"unexpected {item!r}")

    def _fail(self, why: str) -> StepOutcome:
        self.failed = why
        self.close()
        return StepOutcome(error=why)

    def _stderr_tail(self) -> str:
        if self._proc is not None:
            try:  # its output closed: it is ending (or closed its output and goes on: it is killed next)
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                return "it closed its output and kept running"
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace").strip().splitlines()[-2:]
        code = self._proc.returncode if self._proc is not None else None
        return " | ".join(tail) or f"exit code {code}"

    def close(self) -> None:
        if self._proc is not None:
            kill_child(self._proc)
            self._reader.join(timeout=5)
            self._proc = None
            self._stack.close()


STARTUP_S = 30.0


def _pump_timed(stream: IO[bytes], lines: queue.Queue[tuple[float, Any]]) -> None:
    """Each line the child writes, with when it came; (time, None) at its end."""
    for line in iter(lambda: stream.readline(RESULT_CAP + 4096), b""):
        lines.put((time.monotonic(), line))
    lines.put((time.monotonic(), None))


def _why(record: dict[str, Any]) -> str:
    if record.get("status") == "memory":
        return "out of memory (rollout.multi_turn.env_memory_mb)"
    return str(record.get("detail") or record.get("status"))[:300]


def _messages(value: Any) -> list[Message] | None:
    if not isinstance(value, list):
        return None
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return None
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _check_init(value: Any) -> tuple[str, StepOutcome]:
    messages = _messages(value)
    if not messages:
        return f"{_shown(value)}, not a non-empty list of messages ({{'role': str, 'content': str}})", StepOutcome()
    return "", StepOutcome(observations=messages)


def _check_step(value: Any) -> tuple[str, StepOutcome]:
    shape = "not (observation messages, reward, done, info)"
    if not isinstance(value, list) or len(value) != 4:
        return f"{_shown(value)}, {shape}", StepOutcome()
    observations, reward, done, info = value
    messages = _messages(observations)
    if messages is None:
        return f"observations {_shown(observations)}, not a list of messages ({{'role': str, 'content': str}})", \
            StepOutcome()
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return f"reward {_shown(reward)}, not a finite number", StepOutcome()
    if not isinstance(done, bool):
        return f"done {_shown(done)}, not true or false", StepOutcome()
    if not isinstance(info, dict):
        return f"info {_shown(info)}, not a dict", StepOutcome()
    return "", StepOutcome(messages, float(reward), done, info)


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- the protocol, checked before a run ------------------------------------------------------------

# Run in a sandbox job: import the class and say which of the protocol's methods it lacks or takes
# the wrong arguments to (nothing of it is called).
_PROBE = _LOAD_CLASS + """
import inspect
cls = load_class(REF)
problems = []
if not inspect.isclass(cls):
    problems.append("is not a class")
else:
    for name in ("init", "step"):
        method = getattr(cls, name, None)
        if not callable(method):
            problems.append("has no method %s" % name)
            continue
        try:
            inspect.signature(method).bind(None, "x")
        except TypeError:
            problems.append("its %s does not take one argument" % name)
        except ValueError:
            pass
    try:
        inspect.signature(cls).bind()
    except TypeError:
        problems.append("cannot be built without arguments")
    except ValueError:
        pass
result = problems
"""


def check_env(ref: str, limits: EnvLimits, readable: Sequence[str] = ()) -> None:
    """ConfigError in one line for a `rollout.env` that is not an environment: not a class, without the
    protocol's `init(row)` and `step(assistant_text)`, or not buildable without arguments. The class is
    imported in the sandbox, as the episodes will import it."""
    probe_reference("rollout.env", ref, _PROBE, limits, readable, "an environment has init(row) -> messages and "
                    "step(assistant_text) -> (observations, reward, done, info)")


def probe_reference(setting: str, ref: str, probe: str, limits: EnvLimits, readable: Sequence[str],
                    shape: str) -> None:
    """Run `probe` (sandbox code that sets `result` to a list of problems, REF given) in the sandbox;
    ConfigError in one line, "<setting>: <ref> <problems>; <shape>", when it cannot import or finds any."""
    result = run_sandboxed([SandboxJob(code=f"REF = {ref!r}\n" + probe, mode="exec", builtins=True)],
                           SandboxLimits(timeout_s=max(limits.step_timeout_s, STARTUP_S), memory_mb=limits.memory_mb,
                                         isolation=limits.sandbox().isolation), readable)[0]
    if result.status != "ok":
        raise ConfigError(f"{setting}: {ref} could not be imported: {result.detail or result.status}")
    if result.value:
        raise ConfigError(f"{setting}: {ref} {', '.join(result.value)}; {shape}")


def env_files(ref: str) -> list[str]:
    """What the sandbox shows of an environment's or an agent's own code (read-only): its file, or its
    module's top-level package (engine.rewards.sandbox.shown_files)."""
    return shown_files(ref)


# -- how an observation reads after a turn -------------------------------------------------------

_ASSISTANT = "\x01rlflow-assistant\x01"


def observation_text(tokenizer: Any, observations: list[Message], turn_end: str) -> str:
    """The text the model reads after its turn and before its next one: the chat template's end of the
    assistant turn (less `turn_end`, the stop token the model wrote itself), the observation messages, and
    the next assistant header, as the template writes a conversation."""
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _ASSISTANT}]
    plain = str(tokenizer.apply_chat_template(base, tokenize=False))
    full = str(tokenizer.apply_chat_template(base + observations, tokenize=False, add_generation_prompt=True))
    if _ASSISTANT not in plain or not full.startswith(plain[:plain.index(_ASSISTANT) + len(_ASSISTANT)]):
        raise ConfigError("rollout.env: the model's chat template does not write a conversation that goes on "
                          "after an assistant turn")
    after = full[full.index(_ASSISTANT) + len(_ASSISTANT):]
    end = plain[plain.index(_ASSISTANT) + len(_ASSISTANT):]
    if turn_end and end.startswith(turn_end) and after.startswith(turn_end):
        return after[len(turn_end):]
    if turn_end:  # another stop token of the model's stands for the template's end of turn
        return after[len(end):] if after.startswith(end) else after
    return after


def check_chat_template(tokenizer: Any) -> None:
    """ConfigError unless the tokenizer has a chat template that renders an episode's messages."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("rollout.env needs a model whose tokenizer has a chat template: the prompt and the "
                          "observations are chat messages")
    observation_text(tokenizer, [{"role": "user", "content": "o"}], "")


def prompt_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """An episode's prompt tokens: its messages through the chat template, with the assistant header."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])



# -- a batch of episodes -------------------------------------------------------------------------

class EnvEpisodes:
    """rollout.env as the other side of engine.rollout.multi_turn's loop: one EnvSession per row. The prompt
    is init's messages through the chat template (left padded to `width`, data.max_prompt_length); each
    turn's visible text goes to step, whose observations the model reads next (unless the episode is done,
    or out of turns or tokens) and whose reward sits at the turn's last token.

    Adds `env_token_rewards` [B, T] (each step's reward at its turn's last token), `env_reward` [B] (their
    sum; an episode that ended as an error: rollout.multi_turn.env_error_reward), `env_errors` [B] (1 for
    such an episode), `env_steps` [B], and the columns `env_prompt` (init's messages, JSON) and `env_error`
    (why, or "")."""

    def __init__(self, tokenizer: Any, ref: str, limits: EnvLimits, *, width: int, error_reward: float,
                 seeds: list[int], readable: Sequence[str] = ()) -> None:
        self.tokenizer, self.ref, self.limits, self.width = tokenizer, ref, limits, width
        self.error_reward, self.seeds, self.readable = error_reward, seeds, list(readable)
        self.sessions: list[EnvSession] = []
        self.steps: list[int] = []
        self.prompt_messages: list[list[Message]] = []

    def prompts(self, prompts: Any) -> tuple[Any, Any]:
        rows = len(prompts)
        self.steps = [0] * rows
        timeout = self.limits.rollout_timeout_s
        until = time.monotonic() + timeout if timeout is not None else None
        for _ in range(rows):  # appended one by one: close() ends those started if one cannot start
            self.sessions.append(EnvSession(self.ref, self.limits, self.readable, until))
        for r, session in enumerate(self.sessions):
            session.send("init", _row(prompts, r, self.seeds[r]))
        firsts = []
        for session in self.sessions:
            outcome = session.receive("init")
            self.prompt_messages.append(outcome.observations)
            row = prompt_ids(self.tokenizer, outcome.observations) if not outcome.error else []
            if len(row) > self.width:
                session.failed = (f"{session.name}.init gave a prompt of {len(row)} tokens, over "
                                  f"data.max_prompt_length={self.width}")
                session.close()
            firsts.append(row)
        return self._padded(prompts, firsts)

    def _padded(self, prompts: Any, rows: list[list[int]]) -> tuple[Any, Any]:
        """The episodes' prompt tokens, left padded to `width` [B, width], and their mask; an episode that
        failed before its prompt gets the data row's own prompt (the model answers it; its reward is the
        error's)."""
        import torch

        ids = torch.full((len(rows), self.width), int(self.tokenizer.pad_token_id), dtype=torch.long)
        mask = torch.zeros((len(rows), self.width), dtype=torch.long)
        for r, (session, row) in enumerate(zip(self.sessions, rows)):
            if session.failed:
                row = prompts["input_ids"][r][prompts["attention_mask"][r].bool()].tolist()[-self.width:]
            ids[r, self.width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[r, self.width - len(row):] = 1
        return ids, mask

    def cut(self, row: int, ids: list[int]) -> int | None:
        return None  # a turn ends at a stop token (or the length limit)

    def reply(self, turn: int, rows: list[int], ids: list[list[int]], ends: list[str], room: list[bool],
              logps: list[list[float]]) -> list[Any]:
        from engine.rollout.multi_turn import Reply

        for r, new in zip(rows, ids):
            self.sessions[r].send("step", str(self.tokenizer.decode(new, skip_special_tokens=True)))
        replies = []
        for r, end, go in zip(rows, ends, room):
            session = self.sessions[r]
            outcome = session.receive("step")
            if outcome.error:
                replies.append(Reply(None, step={"error": outcome.error}))
                continue
            self.steps[r] += 1
            step = {"reward": outcome.reward, "done": outcome.done, **({"info": outcome.info} if outcome.info else {})}
            if outcome.done or not go:
                session.close()
                replies.append(Reply(None, reward=outcome.reward, step=step))
                continue
            records: list[dict[str, Any]] = [dict(m) for m in outcome.observations]
            replies.append(Reply(observation_text(self.tokenizer, outcome.observations, end), records,
                                 outcome.reward, step))
        return replies

    def columns(self, rows: int, tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
        import torch

        token_rewards = tensors["token_rewards"].clone()
        errors = torch.tensor([1 if s.failed else 0 for s in self.sessions], dtype=torch.long)
        mask = tensors["response_mask"]
        for r in range(rows):
            if errors[r]:  # the whole episode's reward is the error's, at its last generated token
                token_rewards[r] = 0.0
                trained = mask[r].nonzero()
                if len(trained):
                    token_rewards[r, int(trained[-1])] = self.error_reward
        return ({"env_token_rewards": token_rewards, "env_reward": token_rewards.sum(dim=1), "env_errors": errors,
                 "env_steps": torch.tensor(self.steps, dtype=torch.long)},
                {"env_prompt": [json.dumps(m) for m in self.prompt_messages],
                 "env_error": [s.failed for s in self.sessions]})

    def close(self) -> None:
        for session in self.sessions:
            session.close()


def _row(prompts: Any, r: int, seed: int) -> dict[str, Any]:
    """What init(row) gets: the prompt row's fields, and the episode's seed."""
    prompt = prompts["prompt_json"][r] if "prompt_json" in prompts else None
    return {"prompt": json.loads(prompt) if prompt is not None else None,
            "data_source": prompts["data_source"][r], "ground_truth": prompts["ground_truth"][r],
            "extra_info": prompts["extra_info"][r], "seed": seed}
