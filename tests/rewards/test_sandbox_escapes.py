"""Code a model writes or calls, run in the sandbox (engine/rewards/sandbox.py, isolation "bwrap"), tried as
an attacker would: each escape below worked on main (the child ran as our user, unconfined) and fails now.

Needs Debian's bubblewrap (`bwrap`; .ci/run installs it). Where it is missing these tests say so in one line
and skip, except where RLFLOW_SANDBOX_TESTS=required (CI), where they fail."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from engine.rewards import SandboxJob, SandboxLimits, run_sandboxed
from engine.rewards.sandbox import RESULT_CAP

LIMITS = SandboxLimits(timeout_s=3.0, memory_mb=512)


@pytest.fixture(autouse=True)
def bwrap() -> None:
    if shutil.which("bwrap") is None:
        message = "bubblewrap (bwrap) is not installed: apt-get install bubblewrap to run the sandbox tests"
        if os.environ.get("RLFLOW_SANDBOX_TESTS") == "required":
            pytest.fail(message)
        pytest.skip(message)


def run(code: str, limits: SandboxLimits = LIMITS) -> object:
    (result,) = run_sandboxed([SandboxJob(code, mode="exec", builtins=True)], limits)
    assert result.status == "ok", result
    return result.value


def test_no_process_of_ours_is_visible_nor_its_environment() -> None:
    """On main the job read /proc/<parent>/environ: the stage's S3 secret. Here a process of ours holds a
    planted secret in its environment, as a stage process holds the run's credentials."""
    import subprocess

    secret = "planted-" + os.urandom(6).hex()
    holder = subprocess.Popen(["sleep", "60"], env={"AWS_SECRET_ACCESS_KEY": secret})
    try:
        _scan_for(secret, holder.pid)
    finally:
        holder.kill()
        holder.wait()


def _scan_for(secret: str, holder: int) -> None:
    scan = f"""
import os
result = {{"pids": [], "found": []}}
for pid in os.listdir("/proc"):
    if pid.isdigit():
        result["pids"].append(int(pid))
        try:
            if {secret!r}.encode() in open(f"/proc/{{pid}}/environ", "rb").read():
                result["found"].append(int(pid))
        except OSError:
            pass
"""
    found = run(scan)
    assert found["found"] == []  # type: ignore[index]
    assert holder not in found["pids"] and len(found["pids"]) <= 8, found  # type: ignore[index]
    unconfined = run(scan, SandboxLimits(timeout_s=3.0, memory_mb=512, isolation="none"))  # what main did
    assert unconfined["found"] == [holder]  # type: ignore[index]


def test_nothing_outside_its_private_tmp_can_be_written(tmp_path: Path) -> None:
    target = tmp_path / "written-by-the-job"
    got = run(f"""
result = []
for path in ({str(target)!r}, "/etc/rlflow-was-here", "/tmp/mine"):
    try:
        open(path, "w").write("x")
        result.append("wrote " + path)
    except OSError as err:
        result.append(type(err).__name__)
""")
    assert not any(str(g).startswith("wrote") for g in got[:2]), got  # type: ignore[index]
    assert got[2] == "wrote /tmp/mine", got  # its own /tmp is writable  # type: ignore[index]
    assert not target.exists() and not Path("/etc/rlflow-was-here").exists()


def test_no_network_not_even_loopback() -> None:
    """On main the job connected to a server of ours on 127.0.0.1."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        got = run(f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    result = "connected"
except OSError as err:
    result = type(err).__name__
""")
        assert got != "connected", got
        with pytest.raises(socket.timeout):
            server.accept()


def _processes_with(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or []):
            found.append(proc.info["pid"])
    return found


@pytest.mark.parametrize("ends", ["returns", "runs over its timeout"])
def test_nothing_it_starts_outlives_it(ends: str) -> None:
    """On main a child the job started in its own session outlived the timeout's kill (and the caller
    waited for it)."""
    marker = "rlflow-orphan-" + os.urandom(4).hex()
    code = f"""
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # {marker}"], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
result = "started"
"""
    if ends != "returns":
        code += "while True:\n    pass\n"
    start = time.monotonic()
    (result,) = run_sandboxed([SandboxJob(code, mode="exec", builtins=True)], LIMITS)
    assert result.status == ("ok" if ends == "returns" else "timeout"), result
    assert time.monotonic() - start < LIMITS.timeout_s + 3.0
    deadline = time.monotonic() + 3.0
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(marker) == []


def test_a_call_cannot_read_or_forge_another_calls_job_or_result() -> None:
    """Job 0 writes a forged result to every descriptor and /proc path it can reach and reads what it can
    there; job 2 searches its own memory for job 0's code. On main all jobs ran in one process, in turn,
    with the results descriptor open."""
    half1, half2 = "SECRET-" + os.urandom(4).hex(), os.urandom(4).hex() + "-OF-JOB0"
    forged = '{"status": "ok", "value": "forged"}\n'
    job0 = f"""
import os
secret = "{half1 + half2}"
me = str(os.getpid())
mine = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))  # 0-2 (/dev/null), its result pipe, the listing
seen = 0
for pid in [p for p in os.listdir("/proc") if p.isdigit() and p != me]:
    for fd in range(0, 16):
        try:
            handle = os.open(f"/proc/{{pid}}/fd/{{fd}}", os.O_RDWR | os.O_NONBLOCK)
        except OSError:
            continue
        seen += 1
        try:
            os.write(handle, {forged!r}.encode())
        except OSError:
            pass
        os.close(handle)
result = [len(mine), seen]
"""
    job2 = f"""
first, second = "{half1}".encode(), "{half2}".encode()
found = False
for line in open("/proc/self/maps"):
    fields = line.split()
    start, end = (int(x, 16) for x in fields[0].split("-"))
    if "r" not in fields[1] or end - start > 1 << 28:
        continue
    try:
        with open("/proc/self/mem", "rb") as mem:
            mem.seek(start)
            data = mem.read(end - start)
    except (OSError, ValueError, OverflowError):
        continue
    at = data.find(first)
    while at >= 0 and not found:
        found = data[at + len(first):at + len(first) + len(second)] == second
        at = data.find(first, at + 1)
result = found
"""
    spoiler = f"""
import os
for fd in range(0, 256):
    try:
        os.write(fd, {forged!r}.encode())
    except OSError:
        pass
result = "spoiled"
"""
    results = run_sandboxed([SandboxJob(job0, mode="exec", builtins=True), SandboxJob("'real'"),
                             SandboxJob(job2, mode="exec", builtins=True),
                             SandboxJob(spoiler, mode="exec", builtins=True), SandboxJob("'also real'")], LIMITS)
    assert [r.status for r in results] == ["ok", "ok", "ok", "crashed", "ok"], results
    assert results[0].value == [5, 0]  # its own descriptors only; none of another process could be opened
    assert results[1].value == "real" and results[4].value == "also real"  # no forged line reached them
    assert results[2].value is False  # job 0's code is nowhere in job 2's memory
    # a job that writes into every descriptor it has spoils its own result, nobody else's


def test_a_result_is_read_up_to_its_cap() -> None:
    """On main the caller read whatever the child wrote (a job filled its memory through the pipe)."""
    (big, after) = run_sandboxed([SandboxJob(f"'x' * {RESULT_CAP * 8}"), SandboxJob("1 + 1")], LIMITS)
    assert (big.status, big.detail) == ("error", f"its result is over {RESULT_CAP} bytes")
    assert (after.status, after.value) == ("ok", 2)



_FORK_BOMB = """
import os, time
forked, error = 0, None
for _ in range(200):  # bounded: without a cap all 200 start (each sleeps a second and exits)
    try:
        pid = os.fork()
    except OSError as err:
        error = type(err).__name__
        break
    if pid == 0:
        time.sleep(1)
        os._exit(0)
    forked += 1
result = {"forked": forked, "error": error}
"""


def test_a_fork_bomb_meets_the_process_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """On main a job started as many processes as it liked (RLIMIT_NPROC does not bind root) until its
    timeout: the child's pids cgroup stops it at PROCESS_CAP, the next job of the batch runs, and the cgroup
    is gone afterwards. With no cgroup (the cap taken away) the same job starts all 200."""
    from engine.rewards import sandbox

    probe = sandbox._make_pids_cgroup(1)
    if probe is not None:
        probe.rmdir()
    else:
        message = "no writable pids cgroup here: the sandbox's process cap cannot be tested"
        if os.environ.get("RLFLOW_SANDBOX_TESTS") == "required":
            pytest.fail(message)
        pytest.skip(message)
    mine = f"**/rlflow-sandbox-{os.getpid()}-*"  # this process's: another test process may run jobs now
    bomb, after = run_sandboxed([SandboxJob(_FORK_BOMB, mode="exec", builtins=True), SandboxJob("1 + 1")], LIMITS)
    assert bomb.status == "ok" and bomb.value["error"] == "BlockingIOError", bomb  # type: ignore[index]
    # the runner, the zygote, the worker and bubblewrap's own process hold 4 of the cap
    assert sandbox.PROCESS_CAP - 8 <= bomb.value["forked"] <= sandbox.PROCESS_CAP - 4, bomb  # type: ignore[index]
    assert (after.status, after.value) == ("ok", 2)
    assert list(Path("/sys/fs/cgroup/pids").glob(mine)) == []  # removed
    made = sandbox._make_cgroup
    monkeypatch.setattr(sandbox, "_make_cgroup", lambda kind, settings, name: None if kind == "pids" else
                        made(kind, settings, name))
    (uncapped,) = run_sandboxed([SandboxJob(_FORK_BOMB, mode="exec", builtins=True)], LIMITS)
    assert uncapped.value == {"forked": 200, "error": None}, uncapped  # what main did


# Four forks each writing 72 MB: under a per-process cap of 128 MB each fits. Each holds its block until
# every fork holds its own or is gone; `held` counts those that held it to then (their exit code is 0, a
# fork the kernel killed for memory has none). The child's memory cgroup (128 + MEMORY_SLACK_MB for all
# its processes together) has room for two.
_FORKS_HOLDING = """
import os, select
ready_r, ready_w = os.pipe()
go_r, go_w = os.pipe()
kids = {}
for i in range(4):
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(go_w)
        block = b"x" * (72 << 20)  # written: resident
        os.write(ready_w, bytes([i]))
        os.read(go_r, 1)  # until the parent closes its end
        os._exit(0)
    kids[pid] = i
os.close(ready_w)
os.close(go_r)
accounted, codes = set(), {}
while len(accounted) < 4:  # each fork holds its block, or is gone
    if select.select([ready_r], [], [], 0.02)[0]:
        accounted.update(os.read(ready_r, 4))
    for pid in set(kids) - set(codes):
        if os.waitpid(pid, os.WNOHANG)[0]:
            codes[pid] = 1
            accounted.add(kids[pid])
os.close(go_w)
held = 0
for pid in kids:
    if pid not in codes:
        held += os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
"""

# 600 MB of files in its private /tmp (a tmpfs: memory), 15 MB each under the file size cap.
_FILLS_TMP = """
for i in range(40):
    with open(f"/tmp/f{i}", "wb") as f:
        f.write(b"x" * (15 << 20))
result = "wrote 600 MB"
"""


def test_an_episodes_processes_share_one_memory_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """On main the memory cap was each process's address space: 25 forks of 400 MB under a 512 MB cap held
    6 GiB in one episode. The child's memory cgroup caps them together, in a code job and in an
    environment's episode; without it (the cgroup taken away) all four hold their 72 MB, and one warning
    line says the memory is not capped together."""
    from engine.rewards import sandbox
    from engine.rollout.envs import EnvLimits, EnvSession

    probe = sandbox._make_cgroup("memory", {"memory.limit_in_bytes": 1 << 30}, f"rlflow-probe-{os.getpid()}") or \
        sandbox._make_cgroup("memory", {"memory.max": 1 << 30}, f"rlflow-probe-{os.getpid()}")
    if probe is None:
        message = "no writable memory cgroup here: the sandbox's memory cap per episode cannot be tested"
        if os.environ.get("RLFLOW_SANDBOX_TESTS") == "required":
            pytest.fail(message)
        pytest.skip(message)
    probe.rmdir()
    limits = SandboxLimits(timeout_s=10.0, memory_mb=128)
    (job, files) = run_sandboxed([SandboxJob(_FORKS_HOLDING + "result = held", mode="exec", builtins=True),
                                  SandboxJob(_FILLS_TMP, mode="exec", builtins=True)], limits)
    assert job.status == "ok" and job.value <= 2, job
    assert (files.status, files.detail) == ("crashed", "the interpreter exited with code -9"), files  # its /tmp too
    env = tmp_path / "forks.py"
    env.write_text("class Forks:\n    def init(self, row):\n" +
                   "".join(f"        {line}\n" for line in _FORKS_HOLDING.strip().splitlines()) +
                   "        return [{'role': 'user', 'content': str(held)}]\n")
    session = EnvSession(f"{env}:Forks", EnvLimits(step_timeout_s=10.0, memory_mb=128), [str(env)])
    try:
        session.send("init", {})
        outcome = session.receive("init")
    finally:
        session.close()
    assert outcome.error == "" and int(outcome.observations[0]["content"]) <= 2, outcome
    made = sandbox._make_cgroup
    monkeypatch.setattr(sandbox, "_make_cgroup", lambda kind, settings, name: None if kind == "memory" else
                        made(kind, settings, name))
    sandbox._warned.clear()
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlflow.sandbox"):
        (job,) = run_sandboxed([SandboxJob(_FORKS_HOLDING + "result = held", mode="exec", builtins=True)], limits)
    assert (job.status, job.value) == ("ok", 4), job  # what main did
    assert [r.message for r in caplog.records if "memory" in r.message] == [
        "the sandbox cannot cap the memory of a job's or an episode's processes together here (no writable memory "
        "cgroup): each process has its own address-space cap, so N processes hold N times it until the timeout"]


def test_where_bwrap_is_missing_only_pure_tools_run_unless_isolation_is_none(monkeypatch: pytest.MonkeyPatch,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    from engine.errors import RewardError
    from engine.rewards import sandbox
    from engine.rollout.tools import ToolCall, call_tools, load_tools

    monkeypatch.setattr(sandbox, "BWRAP", "bwrap-not-installed-here")
    tools = load_tools([f"{Path(__file__).resolve().parents[1] / 'pipeline' / 'tools.py'}:echo",
                        "engine.rollout.builtin_tools:calculator"])
    calls = [("0", ToolCall("echo", {"text": "abc"})), ("1", ToolCall("calculator", {"expression": "6*7"}))]
    assert call_tools(calls, tools, LIMITS, 200) == [
        "error: echo runs only in the sandbox, and bubblewrap (bwrap) is not installed", "42"]  # calculator: pure
    with pytest.raises(RewardError, match=r"bwrap is not installed: install it \(apt-get install bubblewrap\), or "
                                          r"set reward.sandbox.isolation=none"):
        run_sandboxed([SandboxJob("1 + 1")], LIMITS)  # a code reward
    unconfined = SandboxLimits(timeout_s=3.0, memory_mb=512, isolation="none")
    sandbox._warned.clear()
    caplog.clear()  # the calls above may have warned already (whether they did depends on the tests before)
    with caplog.at_level("WARNING", logger="rlflow.sandbox"):
        assert call_tools(calls, tools, unconfined, 200) == ["cba", "42"]
        assert run_sandboxed([SandboxJob("1 + 1")], unconfined)[0].value == 2
    assert [r.message for r in caplog.records] == [
        "reward.sandbox.isolation=none: code the model writes or calls runs as this user, unconfined (only its "
        "timeout and its memory and process caps apply)"]  # one line


def test_the_isolation_setting_reaches_the_sandbox() -> None:
    from engine.config import RewardConfig

    assert SandboxLimits.from_config(RewardConfig()).isolation == "bwrap"
    assert SandboxLimits.from_config(RewardConfig(sandbox={"isolation": "none"})).isolation == "none"



# -- the stack's secrets -------------------------------------------------------------------------------

_PEEK = '''
import json, os

def peek(paths):
    """What this process sees at each path: a file's text, a folder's names, or why not."""
    seen = {}
    for path in paths:
        try:
            seen[path] = ("listed " + ",".join(sorted(os.listdir(path))) if os.path.isdir(path)
                          else "read " + open(path).read())
        except OSError as err:
            seen[path] = type(err).__name__
    return seen

try:
    from engine.rollout.tools import tool
except ImportError:  # unconfined and outside this checkout's environment
    tool = None

if tool is not None:
    @tool(parameters={"type": "object", "properties": {"paths": {"type": "string"}}, "required": ["paths"]})
    def peek_tool(paths: str) -> str:  # a tool: its observation is what it saw
        return json.dumps(peek(json.loads(paths)))

class Peeker:  # an environment: its prompt is what it saw
    def init(self, row):
        return [{"role": "user", "content": json.dumps(peek(row["paths"]))}]

    def step(self, text):
        return [], 0.0, True, {}

def peeker(client, row):  # an agent: its first call carries what it saw
    client.chat.completions.create(model="policy",
                                   messages=[{"role": "user", "content": json.dumps(peek(row["paths"]))}])
    return 0.0
'''


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list[str], Path]]:
    """Secrets where the stack and the user keep them: a home folder outside /tmp (the sandbox's private /tmp
    hides whatever is there) holding ~/.aws/credentials, ~/.ray/auth_token and another run's local storage;
    and the state folder ($RLFLOW_HOME: credentials/*.ini, stack/prefect_auth, stack/ray_auth_token) inside
    this virtual environment, a folder the sandbox must show (its libraries), so that it must be hidden
    there. Gives the secret, the paths to peek at (the checkout's pyproject.toml too: the checkout is shown
    by its packages only, where ./runs, the default storage root, lies beside them) and the probe's file."""
    secret = "planted-secret-" + os.urandom(6).hex()
    home = Path(f"/var/tmp/rlflow-home-{os.getpid()}-{os.urandom(3).hex()}")
    state = Path(os.path.realpath(sys.prefix)) / f"rlflow-state-{os.getpid()}-{os.urandom(3).hex()}"
    try:
        state.mkdir()
    except OSError as err:
        pytest.skip(f"this virtual environment is not writable here ({err}): the planted state folder needs it")
    files = [home / ".aws" / "credentials", home / ".ray" / "auth_token", home / "runs" / "other-run" / "run.json",
             state / "credentials" / "x.ini", state / "stack" / "prefect_auth", state / "stack" / "ray_auth_token"]
    try:
        for file in files:
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(secret)
            file.chmod(0o600)
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.setenv("RLFLOW_HOME", str(state))
        probe = tmp_path / "peek.py"
        probe.write_text(_PEEK)
        project = Path(__file__).resolve().parents[2]
        paths = [str(f) for f in files] + [str(home), str(state), str(project / "pyproject.toml")]
        yield secret, paths, probe
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)


def _saw_nothing(seen: dict[str, str], secret: str, paths: list[str]) -> None:
    assert sorted(seen) == sorted(paths), seen  # the probe ran and answered for each path
    assert secret not in json.dumps(seen), seen
    # each path is missing, or an empty folder (the state folder, masked inside the environment's folder)
    assert {p: what for p, what in seen.items() if what not in ("FileNotFoundError", "listed ")} == {}, seen


def test_a_tool_sees_none_of_the_stacks_secrets(planted: tuple[str, list[str], Path]) -> None:
    """On main a tool read them all (the sandbox bound / read-only as our user: mode 0600 protected nothing).
    Unconfined, the same tool reads each one: they are there to read."""
    from engine.rollout.tools import ToolCall, call_tools, load_tools

    secret, paths, probe = planted
    tools = load_tools([f"{probe}:peek_tool"])
    call = [("0", ToolCall("peek_tool", {"paths": json.dumps(paths)}))]
    (got,) = call_tools(call, tools, SandboxLimits(timeout_s=10.0, memory_mb=512), 100_000)
    _saw_nothing(json.loads(got), secret, paths)
    (got,) = call_tools(call, tools, SandboxLimits(timeout_s=10.0, memory_mb=512, isolation="none"), 100_000)
    assert [what for what in json.loads(got).values()].count("read " + secret) == 6, got


def test_an_environment_sees_none_of_the_stacks_secrets(planted: tuple[str, list[str], Path]) -> None:
    from engine.rollout.envs import EnvLimits, EnvSession, env_files

    secret, paths, probe = planted
    ref = f"{probe}:Peeker"
    session = EnvSession(ref, EnvLimits(step_timeout_s=10.0, memory_mb=512), env_files(ref))
    try:
        session.send("init", {"paths": paths})
        outcome = session.receive("init")
    finally:
        session.close()
    assert outcome.error == "", outcome
    _saw_nothing(json.loads(outcome.observations[0]["content"]), secret, paths)


def test_an_agent_sees_none_of_the_stacks_secrets(planted: tuple[str, list[str], Path]) -> None:
    from engine.rollout.agents import AgentSession, Call, Sampling
    from engine.rollout.envs import EnvLimits, env_files

    secret, paths, probe = planted
    ref = f"{probe}:peeker"
    session = AgentSession(ref, EnvLimits(step_timeout_s=10.0, memory_mb=512), env_files(ref),
                           sampling=Sampling(temperature=1.0, top_p=1.0, max_tokens=64))
    try:
        call = session.start({"paths": paths})
    finally:
        session.close()
    assert isinstance(call, Call), (call, session.failed)
    _saw_nothing(json.loads(call.body["messages"][0]["content"]), secret, paths)
