"""Black-box agents (`rollout.agent=module:function` or `path/to/file.py:function`): any agent written
against the `openai` package is a rollout.

    def agent(client: openai.OpenAI, row: dict) -> float:
        messages = [{"role": "user", "content": row["prompt"][-1]["content"]}]
        reply = client.chat.completions.create(model="policy", messages=messages)
        ...                                    # tools, parsing, more calls with the conversation so far
        return reward

`row` is what an environment's init gets (engine.rollout.envs: the data row's fields and a `seed` for
what the agent draws). Each episode's agent runs in a sandbox child of its own (as an environment does),
with an OpenAI client whose transport is a Unix socket bound into that sandbox alone and whose API key is
the episode's own: the engine serves `/v1/chat/completions` there during the rollout stage, and nothing
else reaches the agent or leaves it but the float it returns.

The episode is the agent's calls. The first call's messages, through the chat template, are the row's
prompt; each answer is a turn the policy samples (rollout.temperature and top_p, the run's seeds). A later
call must send the conversation so far: the earlier messages, the assistant's reply as it was answered,
then the new messages (a tool's result, a user's reply), which the model reads as observations (holes in
the response mask), written as the chat template writes them. The row keeps the tokens the engine
sampled and their log-probs, never a re-tokenisation of the text. The returned float is the episode's
reward, at its last sampled token.

The endpoint samples as the run does: a request may name `temperature` or `top_p` only with the run's
values (numbers; true is not one), `n` 1, no streaming, no tools, stop strings or seed; a message's role is
system, user, assistant or tool, and no message the model will read (a first call's, what a later call
adds) may hold the text of one of the tokenizer's special tokens, which the tokenizer would read as that
token and so forge the turns (other text, control characters included, is data: a tool's output may hold
them). Each is checked as the request arrives and answered with a 400 that names it; the episode then ends
as an error. `max_tokens` (or `max_completion_tokens`, an integer up to rollout.max_new_tokens) cuts that
answer; `logprobs` returns the sampled tokens' log-probs. Every answer carries the sampled `token_ids` (in its choice, as
vLLM's `return_token_ids` does). When the episode has no turns or tokens left, the next call is answered
with a 400 (as a server answers a prompt over its context) and the agent's return ends the episode.
Deadlines and errors are an environment's (rollout.multi_turn.env_*): the agent has env_step_timeout_s
from each answer to its next call or its return; a raise, a hang, a call that does not continue the
conversation, or a return that is not a finite number ends the episode as an error.

What the agent's process may send the endpoint is bounded: a body of one Content-Length up to BODY_CAP
(anything else is a 400 or a 413 before the body is read), JSON parsed totally (too deep is a 400),
MAX_CONNECTIONS connections at once and READ_TIMEOUT_S for each read of one. Its processes' memory is the
episode's, with the environment's (engine.rewards.sandbox.child_cgroups).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import shutil
import socketserver
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from engine.errors import ConfigError
from engine.rollout.envs import (
    _CHILD_HEAD,
    _LOAD_CLASS,
    EnvEpisodes,
    EnvLimits,
    EnvSession,
    Message,
    _row,
    _shown,
    _why,
    observation_text,
    probe_reference,
    prompt_ids,
)

log = logging.getLogger("rlflow.agents")

# The child: import the function and the openai client, say ready, read the row, run the agent, answer
# with what it returned. The API key comes on stdin (not in the command line, which `ps` shows).
_AGENT_CHILD = _LOAD_CLASS + _CHILD_HEAD + r"""
socket_path = sys.argv[5]
key = sys.stdin.readline().strip()
try:
    import httpx, openai
    function = load_class(ref)
    client = openai.OpenAI(base_url="http://rlflow/v1", api_key=key, max_retries=0, timeout=None,
                           http_client=httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), timeout=None))
except BaseException as err:
    answer(failure(err))
    sys.exit(0)
answer({"status": "ready"})
row = json.loads(sys.stdin.readline())
try:
    record = {"status": "ok", "value": function(client, row)}
except BaseException as err:
    record = failure(err)
answer(record)
"""

BODY_CAP = 4 * 2**20  # a request's body at most
# An episode's endpoint holds at most this many connections at once (a connection past them is closed at
# once: an agent makes one call at a time), and each waits at most READ_TIMEOUT_S for each piece of a
# request (its headers, its body) and for the next request on a kept-alive connection; so an agent that
# opens thousands of connections, or sends half a request and stops, holds a few threads of the engine,
# not thousands, and only until its episode ends (its process is killed; the connections with it).
MAX_CONNECTIONS = 4
READ_TIMEOUT_S = 10.0
ROLES = ("system", "user", "assistant", "tool")  # what a message's role may be (the chat template writes it)
SERVED = {"model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "logprobs", "n",
          "stream", "top_logprobs", "return_token_ids"}


@dataclass
class Call:
    """One request of the agent, waiting for its answer: what it asks, checked, or why it is refused (it is
    answered with a 400 at once, and its episode ends as an error)."""

    body: Any
    request: Request | None = None
    problem: str = ""
    status: int = 0
    response: dict[str, Any] = field(default_factory=dict)
    answered: threading.Event = field(default_factory=threading.Event)

    def answer(self, status: int, response: dict[str, Any]) -> None:
        self.status, self.response = status, response
        self.answered.set()


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    timeout = READ_TIMEOUT_S  # on each read and write of the connection (socketserver's StreamRequestHandler)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._send(404, _error(f"{self.path}: only POST /v1/chat/completions is served"))

    def do_POST(self) -> None:  # noqa: N802
        session = self.server.session
        length = _content_length(self.headers.get_all("Content-Length") or [], self.headers.get("Transfer-Encoding"))
        if isinstance(length, str):  # its body cannot be told from a next request: answered, then closed
            self.close_connection = True
            self._send(413 if length.startswith("a request's body") else 400, _error(length))
            return
        try:  # read before any answer, so that the client is not cut off mid-send (at most BODY_CAP)
            data = self.rfile.read(length)
        except OSError:  # the agent stopped sending (READ_TIMEOUT_S) or went away
            self.close_connection = True
            return
        if self.headers.get("Authorization") != f"Bearer {session.key}":
            self._send(401, _error("not this episode's key"))
            return
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._send(404, _error(f"{self.path}: only POST /v1/chat/completions is served"))
            return
        try:
            body = json.loads(data)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, cut short, or nested past Python's stack
            self._send(400, _error("the body is not JSON"))
            return
        call = session.arrived(body)
        if call is None:
            self._send(409, _error("one call at a time: an earlier call of this episode is not answered yet"))
            return
        call.answered.wait()
        self._send(call.status, call.response)

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the agent is gone (its episode ended and its process was killed)
            self.close_connection = True


def _content_length(values: list[str], transfer_encoding: str | None) -> int | str:
    """A request's body length from its one Content-Length header, or why it is refused."""
    if transfer_encoding is not None:
        return f"Transfer-Encoding: {transfer_encoding[:40]!r} is not served: send the body with a Content-Length"
    if len(values) != 1 or not re.fullmatch(r"[0-9]{1,16}", values[0].strip()):
        shown = ", ".join(repr(v[:40]) for v in values) or "none"
        return f"Content-Length: {shown}; one byte count from 0 to {BODY_CAP} is required"
    length = int(values[0])
    return length if length <= BODY_CAP else f"a request's body is at most {BODY_CAP} bytes"


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, session: AgentSession) -> None:
        self.session = session
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(path, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # MAX_CONNECTIONS open already: closed, no thread
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """What a connection's handler raised: one line, not socketserver's traceback on stderr (whatever
        the agent sends is answered; this is for what is left, such as a connection reset mid-answer)."""
        log.warning("the agent endpoint dropped a connection: %s", sys.exc_info()[1])


class AgentSession(EnvSession):
    """One episode's agent: a sandbox child of its own, and the endpoint its client reaches (a Unix socket
    in a folder only this process and that sandbox see, and a key of its own)."""

    KIND = "agent"
    CHILD = _AGENT_CHILD

    def __init__(self, ref: str, limits: EnvLimits, readable: Sequence[str] = (), until: float | None = None, *,
                 sampling: Sampling, special: Sequence[str] = ()) -> None:
        """`sampling`: what a request may ask (check_request); `special`: the tokenizer's special tokens,
        which no message the model will read may hold."""
        self.key = secrets.token_hex(16)
        self.sampling, self.special = sampling, tuple(special)
        self.calls = 0  # the calls answered with a turn
        self.messages: list[Message] = []  # the conversation of the last call
        self.replied = ""  # the text of the last answer
        self._folder = tempfile.mkdtemp(prefix="rlflow-agent-")  # mode 0700
        self.socket_path = os.path.join(self._folder, "api.sock")
        self._lock = threading.Lock()
        self.pending: Call | None = None  # the call the loop has not answered yet
        self._server = _Server(self.socket_path, self)
        self._serving = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                         daemon=True)
        self._serving.start()
        try:
            super().__init__(ref, limits, [*readable, self.socket_path], until, child_args=[self.socket_path])
        except BaseException:
            self._stop_serving()
            raise

    def arrived(self, body: Any) -> Call | None:
        """A request from the agent (the server's thread), checked: queued for the loop; a refused one is
        answered (400) at once and queued too (the loop ends the episode); None while another waits."""
        problem, request = check_request(body, self.sampling)
        if not problem and request is not None:
            problem = self._special_in(request.messages)
        with self._lock:
            if self._proc is None:
                return _closed_call()
            if problem:
                call = Call(body, problem=problem)
                call.answer(400, _error(problem))
                self._lines.put((time.monotonic(), call))
                return call
            if self.pending is not None:
                return None
            self.pending = Call(body, request)
            self._lines.put((time.monotonic(), self.pending))
            return self.pending

    def _special_in(self, messages: list[Message]) -> str:
        """Why the messages the model will read as tokens (a first call's, a later call's after the
        conversation so far) are refused, or "": one holds a special token's text, which the tokenizer would
        read as that token (an end of turn, a role's header: a conversation it did not have)."""
        before = self.messages + [{"role": "assistant", "content": self.replied}] if self.calls else []
        start = len(before) if messages[:len(before)] == before else 0
        for i, m in enumerate(messages[start:], start):
            found = next((t for t in self.special if t in m["content"]), None)
            if found is not None:
                return (f"messages[{i}].content holds {found!r}, the model's special token: a message is text, "
                        "and the chat template writes the turns' tokens")
        return ""

    def _event(self, item: Any) -> Any:
        return item  # a Call

    def start(self, row: dict[str, Any]) -> Call | float | None:
        """Send the key and the row; the agent's first call, its return (a reward), or None (failed)."""
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(f"{self.key}\n{json.dumps(row, default=str)}\n".encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the child is gone: the answer it never gives says so
        ready = self._answer(f"{self.name}'s start")
        if ready is None:
            return None
        if not isinstance(ready, dict) or ready.get("status") != "ready":
            self._fail(f"{self.name} could not be loaded: {_why(ready) if isinstance(ready, dict) else 'no answer'}")
            return None
        self._allowed = self.limits.step_timeout_s  # the first call's deadline runs from the child being ready
        return self.wait("its first call")

    def respond(self, status: int, body: dict[str, Any]) -> None:
        """Answer the pending call; the agent's deadline for its next call (or return) starts now."""
        with self._lock:
            call, self.pending = self.pending, None
        if call is not None:
            call.answer(status, body)
        self._sent, self._allowed = time.monotonic(), self.limits.step_timeout_s

    def refuse(self, why: str) -> None:
        """Answer the pending call with a 400 saying `why`; the episode ends as an error."""
        self.respond(400, _error(why))
        self._fail(f"{self.name}'s call {self.calls + 1}: {why}")

    def wait(self, what: str) -> Call | float | None:
        """The agent's next call, its reward (it returned), or None: the episode failed."""
        item = self._answer(f"{self.name}: {what}")
        if item is None or isinstance(item, Call):
            return item
        if item.get("status") != "ok":
            self._fail(f"{self.name} failed: {_why(item)}")
            return None
        value = item.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self._fail(f"{self.name} returned {_shown(value)}, not a finite number (the episode's reward)")
            return None
        return float(value)

    def close(self) -> None:
        super().close()  # the child first: nothing calls after this
        with self._lock:
            call, self.pending = self.pending, None
        if call is not None:
            call.answer(503, _error("the episode is over"))
        self._stop_serving()

    def _stop_serving(self) -> None:
        if self._serving.is_alive():
            self._server.shutdown()
        self._server.server_close()
        shutil.rmtree(self._folder, ignore_errors=True)


def special_tokens(tokenizer: Any) -> list[str]:
    """The text of each of the tokenizer's special tokens (its end of turn, its roles' headers...)."""
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            found.add(str(token.content))
    return sorted(t for t in found if t)


def _closed_call() -> Call:
    call = Call(None)
    call.answer(503, _error("the episode is over"))
    return call


@dataclass(frozen=True)
class Sampling:
    """The run's sampling, which a request may restate but not change, and the most tokens it may ask for."""

    temperature: float
    top_p: float
    max_tokens: int  # rollout.max_new_tokens: an episode's response tokens, all its turns together


@dataclass
class Request:
    messages: list[Message]
    max_tokens: int | None
    logprobs: bool


def check_request(body: Any, sampling: Sampling) -> tuple[str, Request | None]:
    """(why the request is refused, or ""; what it asks). A total function of the parsed body."""
    if not isinstance(body, dict):
        return "the body is not a JSON object", None
    extra = sorted(str(k) for k, v in body.items() if k not in SERVED and v is not None)
    if extra:
        return (f"{_shown(extra[0])} is not served: rlflow's endpoint samples as the run does (served: "
                f"{', '.join(sorted(SERVED))})"), None
    for key, run in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value != run):
            return (f"{key}={_shown(value)}: the run samples with rollout.{key}={run!r} (a number: leave it out, "
                    "or give that)"), None
    if body.get("n") is not None and (isinstance(body["n"], bool) or body["n"] != 1):
        return f"n={_shown(body['n'])}: one answer a call (rollout.n makes the group)", None
    if body.get("stream") not in (None, False):
        return "stream is not served: an answer comes whole", None
    if body.get("top_logprobs") is not None and (isinstance(body["top_logprobs"], bool) or body["top_logprobs"] != 0):
        return "top_logprobs is not served: logprobs=true gives the sampled tokens' log-probs", None
    if body.get("logprobs") not in (None, True, False):
        return f"logprobs={_shown(body['logprobs'])}: true or false", None
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    limit = body.get(key)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or
                              not 1 <= limit <= sampling.max_tokens):
        return (f"{key}={_shown(limit)}: an integer from 1 to {sampling.max_tokens} (rollout.max_new_tokens, "
                "the episode's tokens)"), None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: a non-empty list of {'role': ..., 'content': str}", None
    kept: list[Message] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"messages[{i}]: not {{'role': str, 'content': str}} (text content only)", None
        if m["role"] not in ROLES:
            return f"messages[{i}].role={_shown(m['role'])}: one of {', '.join(ROLES)}", None
        other = sorted(str(k) for k, v in m.items() if k not in ("role", "content") and v not in (None, [], ""))
        if other:
            return f"messages[{i}].{_shown(other[0])} is not served (role and text content only)", None
        kept.append({"role": m["role"], "content": m["content"]})
    return "", Request(kept, limit, body.get("logprobs") is True)


def completion(tokenizer: Any, session: AgentSession, model: Any, ids: list[int], logps: list[float],
               finish: str, with_logprobs: bool) -> dict[str, Any]:
    """The chat.completion answering the pending call: the turn's text, its token ids, and log-probs."""
    text = str(tokenizer.decode(ids, skip_special_tokens=True))
    logprobs = None
    if with_logprobs:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        logprobs = {"content": [
            {"token": str(piece), "logprob": lp, "top_logprobs": [],
             "bytes": list(tokenizer.decode([i], skip_special_tokens=False).encode())}
            for i, piece, lp in zip(ids, pieces, logps)]}
    return {"id": f"chatcmpl-{session.key[:8]}-{session.calls}", "object": "chat.completion",
            "created": int(time.time()), "model": model if isinstance(model, str) else "policy",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                         "logprobs": logprobs, "token_ids": list(ids)}]}


class AgentEpisodes(EnvEpisodes):
    """rollout.agent as the other side of engine.rollout.multi_turn's loop: one AgentSession per row. It
    fills the columns an environment's episodes do (EnvEpisodes: env_reward, env_errors, env_steps: the
    turns the agent took up, by its next call or its return, as an environment's steps; env_prompt: the
    first call's messages, env_error)."""

    def __init__(self, tokenizer: Any, ref: str, limits: EnvLimits, *, width: int, error_reward: float,
                 seeds: list[int], sampling: Sampling, readable: Sequence[str] = ()) -> None:
        super().__init__(tokenizer, ref, limits, width=width, error_reward=error_reward, seeds=seeds,
                         readable=readable)
        self.sampling = sampling
        self.special = special_tokens(tokenizer)
        self.agents: list[AgentSession] = []
        self.asked: list[Request | None] = []  # each row's pending request
        self.rewards: list[float | None] = []  # what each agent returned

    def prompts(self, prompts: Any) -> tuple[Any, Any]:
        rows = len(prompts)
        self.steps = [0] * rows
        self.asked, self.rewards = [None] * rows, [None] * rows
        timeout = self.limits.rollout_timeout_s
        until = time.monotonic() + timeout if timeout is not None else None
        # A window of children starting at once (each imports openai: ~0.5 s of CPU): the start-up
        # deadline of each runs from its own start, not behind dozens of others on two cores.
        window = max(2, os.cpu_count() or 1)
        self.sessions = self.agents  # close() ends those started if one cannot start
        firsts: list[Call | float | None] = []
        for r in range(rows):
            if r >= window:
                firsts.append(self.agents[r - window].start(_row(prompts, r - window, self.seeds[r - window])))
            self.agents.append(AgentSession(self.ref, self.limits, self.readable, until, sampling=self.sampling,
                                            special=self.special))
        for r in range(max(0, rows - window), rows):
            firsts.append(self.agents[r].start(_row(prompts, r, self.seeds[r])))
        silent, rows_ids = 0, []
        for r, (agent, first) in enumerate(zip(self.agents, firsts)):
            row: list[int] = []
            if isinstance(first, float):
                silent += 1
                agent._fail(f"{agent.name} returned without calling the endpoint (client.chat.completions.create)")
            elif isinstance(first, Call):
                request = self._take(r, first)
                if request is not None:
                    agent.messages = request.messages
                    row = prompt_ids(self.tokenizer, request.messages)
                    if len(row) > self.width:
                        agent.refuse(f"the first call's prompt is {len(row)} tokens, over data.max_prompt_length="
                                     f"{self.width}")
            self.prompt_messages.append(agent.messages)
            rows_ids.append(row)
        if rows and silent == rows:
            raise ConfigError(f"rollout.agent: {self.ref} returned without calling the endpoint in every episode: an "
                              "agent's episode is its calls of client.chat.completions.create")
        return self._padded(prompts, rows_ids)

    def _take(self, r: int, call: Call) -> Request | None:
        """Row r's call's request, checked when it arrived (refused: answered with a 400 already; None, and
        the episode ends as an error)."""
        agent = self.agents[r]
        if call.problem or call.request is None:
            agent._fail(f"{agent.name}'s call {agent.calls + 1}: {call.problem}")
            return None
        self.asked[r] = call.request
        return call.request

    def cut(self, row: int, ids: list[int]) -> int | None:
        request = self.asked[row] if row < len(self.asked) else None
        if request is not None and request.max_tokens is not None and len(ids) > request.max_tokens:
            return request.max_tokens
        return None

    def reply(self, turn: int, rows: list[int], ids: list[list[int]], ends: list[str], room: list[bool],
              logps: list[list[float]]) -> list[Any]:
        from engine.rollout.multi_turn import Reply

        for r, new, lp, end in zip(rows, ids, logps, ends):
            agent, request = self.agents[r], self.asked[r]
            if agent.failed or request is None:
                continue
            body = agent.pending.body if agent.pending is not None else {}
            finish = "stop" if end else "length"
            answer = completion(self.tokenizer, agent, body.get("model"), new, lp, finish, request.logprobs)
            agent.calls += 1  # before the answer: the agent's next call is checked against them (_special_in)
            agent.replied = str(self.tokenizer.decode(new, skip_special_tokens=True))
            agent.respond(200, answer)
        replies = []
        for r, end, go in zip(rows, ends, room):
            agent = self.agents[r]
            waited = agent.wait(f"its call {agent.calls + 1} or its return") if not agent.failed else None
            event = self._continued(r, waited, end, go) if isinstance(waited, Call) else waited
            if isinstance(event, (tuple, float)):  # the turn is taken: a step, as an environment's answer is
                self.steps[r] += 1
            if isinstance(event, tuple):  # the episode goes on: the model reads the new messages
                text, said = event
                replies.append(Reply(text, [dict(m) for m in said]))
            elif isinstance(event, float):
                self.rewards[r] = event
                agent.close()
                replies.append(Reply(None, reward=event, step={"reward": event, "done": True}))
            else:
                replies.append(Reply(None, step={"error": agent.failed}))
        return replies

    def _continued(self, r: int, call: Call, end: str, go: bool) -> tuple[str, list[Message]] | float | None:
        """A later call: (the text the model reads next, the new messages); or, with no room left, the
        agent's return after a 400; or None (refused: the episode failed)."""
        agent = self.agents[r]
        request = self._take(r, call)
        if request is None:
            return None
        before = agent.messages + [{"role": "assistant", "content": agent.replied}]
        if request.messages[:len(before)] != before:
            agent.refuse(f"it does not continue the conversation: a call sends the earlier messages and the "
                         f"assistant's reply as answered ({_shown(agent.replied)}), then what is new")
            return None
        new = request.messages[len(before):]
        if not new:
            agent.refuse("it adds no message after the assistant's reply: the model answers what is new")
            return None
        if not go:
            return self._out_of_room(r)
        text = observation_text(self.tokenizer, new, end)
        agent.messages = request.messages
        return text, new

    def _out_of_room(self, r: int) -> float | None:
        """Answer the pending call with a 400 (no turns or tokens left); the agent's return, or None."""
        agent = self.agents[r]
        agent.respond(400, _error("the episode has no room left (rollout.multi_turn.max_turns, "
                                  "rollout.max_new_tokens): return its reward"))
        self.asked[r] = None
        event = agent.wait("its return, after its room ran out")
        if isinstance(event, Call):
            agent.refuse("the episode has no room left")
            return None
        if isinstance(event, float):
            self.rewards[r] = event
            agent.close()
        return event

    def columns(self, rows: int, tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
        token_rewards = tensors["token_rewards"].clone()
        for r, agent in enumerate(self.agents):  # its last call came with the response already full
            if not agent.failed and self.rewards[r] is None and agent.pending is not None:
                reward = self._out_of_room(r)
                trained = tensors["response_mask"][r].nonzero()
                if reward is not None and len(trained):
                    token_rewards[r, int(trained[-1])] += reward
        return super().columns(rows, {**tensors, "token_rewards": token_rewards})


# -- the signature, checked before a run -----------------------------------------------------------

_PROBE = _LOAD_CLASS + """
import inspect
problems = []
try:
    import openai
except ImportError:
    problems.append("needs the openai package, which this environment does not have (pip install openai)")
function = load_class(REF)
if not callable(function) or inspect.isclass(function):
    problems.append("is not a function")
else:
    try:
        inspect.signature(function).bind("client", "row")
    except TypeError:
        problems.append("does not take (client, row)")
    except ValueError:
        pass
result = problems
"""


def check_agent(ref: str, limits: EnvLimits, readable: Sequence[str] = ()) -> None:
    """ConfigError in one line for a `rollout.agent` that is not an agent: not a function of (client, row),
    or the openai package missing. The function is imported in the sandbox, as its episodes import it."""
    probe_reference("rollout.agent", ref, _PROBE, limits, readable, "an agent is function(client, row) -> reward, "
                    "client an openai.OpenAI")
