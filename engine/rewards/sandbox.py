"""Run code a model wrote (a code reward) or asked for (a tool call): confined, limited, one job at a time.

One child per batch, started once: in Debian's bubblewrap (isolation "bwrap", the default) with new
user, PID, network, IPC and UTS namespaces, only the files it needs shown, read-only (`file_view`: never the
home folder, the state folder, credentials or another run's storage), a private /tmp, no capabilities and
an empty environment; the child is the namespace's init, so when it ends (or is killed
at a timeout) everything a job started ends with it. Inside, a runner takes one job at a time from this
process and a zygote, forked before any job arrived, forks a clean worker per job: a job cannot see
another's code or result (no memory, descriptor or /proc path reaches them: the runner and zygote are not
dumpable, and this process sends a job only after the last result). Limits per job: `RLIMIT_AS` at
`memory_mb` (an allocation beyond it is a MemoryError: "memory"), CPU seconds, a file size cap, a result
read up to RESULT_CAP bytes, and `timeout_s` of wall clock from the moment the job is sent ("timeout":
the child is killed and a new one takes the jobs after it). The child's processes, everything its jobs
start included, are capped at PROCESS_CAP by a pids cgroup of its own (a fork bomb's fork fails with
EAGAIN): RLIMIT_NPROC cannot do it (the kernel exempts root's processes from it, and for another user it
counts every process of that user). Their memory together, files in its /tmp included, is capped by a
memory cgroup of its own at memory_mb + MEMORY_SLACK_MB (RLIMIT_AS is per process: forks multiply it);
past it the kernel kills the largest of them. Where this process may make no such cgroup (cgroup v1's
`pids` or `memory` hierarchy, or a delegated v2 controller), one warning line says that cap is missing;
the timeout and the namespace's end still bound what the child holds. Measured per job: bench/sandbox_overhead.py (BENCHMARKS.md).

Who is to blame decides what happens (see engine.rewards.python_expr for how scores follow):
  * anything a job does once the child is ready (raise, loop forever, exhaust memory, crash its process,
    write garbage) is the generated program's doing and becomes that job's status;
  * a child that cannot even start (no interpreter, a cap too small to import json, no bwrap) is a broken
    environment and raises RewardError: it must fail the stage, not score every response 0.

isolation "none" runs the same child without bubblewrap, as this user (one warning line says so): only
the limits above apply. The escapes it allows are tests/rewards/test_sandbox_escapes.py's.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Literal

from engine.errors import RewardError
from engine.rewards.types import SandboxLimits

log = logging.getLogger("rlflow.sandbox")
Status = Literal["ok", "error", "timeout", "memory", "crashed"]

_STARTUP_TIMEOUT_S = 30.0  # generous: a cold interpreter on a loaded machine

# The child: a runner and a zygote. The zygote is forked before any job arrives and forks one worker per
# job, so a worker's memory holds nothing of another job (no code, no result); the runner is made
# non-dumpable, so a worker cannot read its memory or descriptors through /proc. Per job: the runner asks
# the zygote for a worker, gets the worker's two pipe ends over a Unix socket, writes the job, reads at
# most `out_cap` bytes of result, and writes one checked JSON line to the parent. The parent sends the
# next job only after the last result (so no job waits in a buffer a worker could read).
_CHILD = r"""
import json, os, resource, socket, sys
cap, out_cap, fsize, cpu_s = (int(a) for a in sys.argv[1:5])
os.environ.pop("PWD", None)  # bubblewrap's: the jobs get no environment but PATH
results = os.fdopen(os.dup(1), "w")
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
probe = bytearray(8 << 20)  # a cap with no room for any job fails here, loudly, not as a 0 for every job
del probe
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 1)
os.dup2(null, 2)
try:  # nobody (a worker, the same user) reads the runner's or the zygote's memory or descriptors through /proc
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0 (inherited by the zygote and its workers)
except Exception:
    pass
runner_end, zygote_end = socket.socketpair()
if os.fork() == 0:  # the zygote: it never sees a job
    runner_end.close()
    results.close()
    os.dup2(null, 0)
    while zygote_end.recv(1):
        job_r, job_w = os.pipe()
        out_r, out_w = os.pipe()
        worker = os.fork()
        if worker == 0:  # a worker: its own job in, its own result out, nothing else open
            for fd in range(3, 1024):
                if fd not in (job_r, out_w):
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
            with os.fdopen(job_r, "rb") as f:
                job = json.loads(f.read())
            env = {} if job["builtins"] else {"__builtins__": {}}
            try:
                code = compile(job["code"], "<generated>", job["mode"])
                if job["mode"] == "eval":
                    value = eval(code, env)
                else:
                    exec(code, env)
                    value = env.get("result")
                line = json.dumps({"status": "ok", "value": value})
            except MemoryError:
                env = code = value = None
                line = '{"status": "memory", "detail": "MemoryError"}'
            except BaseException as err:
                try:
                    detail = (type(err).__name__ + ": " + str(err))[:300]
                except BaseException:
                    detail = type(err).__name__
                line = json.dumps({"status": "error", "detail": detail})
            data = line.encode()
            while data:
                data = data[os.write(out_w, data[:65536]):]
            os._exit(0)
        socket.send_fds(zygote_end, [b"w"], [job_w, out_r])
        for fd in (job_r, job_w, out_r, out_w):
            os.close(fd)
        code = os.waitstatus_to_exitcode(os.waitpid(worker, 0)[1])
        zygote_end.sendall(b"%d\n" % code)  # how the worker ended, after its result
    os._exit(0)
zygote_end.close()
results.write('{"ready": true}\n')
results.flush()
for request in sys.stdin.buffer:
    runner_end.sendall(b"j")
    _, (job_w, out_r), _, _ = socket.recv_fds(runner_end, 1, 2)
    with os.fdopen(job_w, "wb") as f:
        f.write(request)
    data, chunk = b"", b"x"
    with os.fdopen(out_r, "rb") as f:
        while chunk and len(data) <= out_cap:
            chunk = f.read(65536)
            data += chunk
    code = int(runner_end.recv(32))
    if len(data) > out_cap:
        line = json.dumps({"status": "error", "detail": "its result is over %d bytes" % out_cap})
    else:
        try:
            record = json.loads(data)
            ok = isinstance(record, dict) and record.get("status") in ("ok", "error", "memory", "crashed")
        except ValueError:
            ok = False
        line = data.decode() if ok else json.dumps({"status": "crashed",
                                                    "detail": "the interpreter exited with code %d" % code})
    results.write(line + "\n")
    results.flush()
"""

# What a job may hold and write: its result (read up to this), files (RLIMIT_FSIZE), CPU seconds.
RESULT_CAP = 1 << 20
FILE_CAP = 16 << 20
# Processes of one child at once, bubblewrap's included: the runner, the zygote and a worker are 3.
PROCESS_CAP = 32
# A child's memory cgroup holds memory_mb (each process's own address-space cap) and this much more: the
# runner and the zygote of a batch, bubblewrap's process, so that a job that fills its own cap still meets
# its MemoryError there ("memory"), not the cgroup's kill. Forks of a job or an episode share the whole.
MEMORY_SLACK_MB = 64

@dataclass(frozen=True)
class SandboxJob:
    """Source to run. `eval`: the value of an expression. `exec`: the global `result` after the code ran.

    The value must be JSON-able (numbers, strings, lists, dicts); anything else is an "error".
    `builtins=False` runs with no builtins at all (enough for arithmetic).
    """

    code: str
    mode: Literal["eval", "exec"] = "eval"
    builtins: bool = False


@dataclass(frozen=True)
class SandboxResult:
    status: Status
    value: Any = None
    detail: str = ""
    elapsed_s: float = 0.0


def run_sandboxed(jobs: Sequence[SandboxJob], limits: SandboxLimits, readable: Sequence[str] = ()
                  ) -> list[SandboxResult]:
    """Run `jobs` in child processes under `limits`; one result per job, in order. `readable`: files or
    folders the jobs read (a tool's file), shown read-only where the sandbox's private /tmp hides them."""
    results: list[SandboxResult] = []
    while len(results) < len(jobs):
        results.extend(_run_child(jobs[len(results) :], limits, readable))
    return results


def _run_child(jobs: Sequence[SandboxJob], limits: SandboxLimits, readable: Sequence[str] = ()
               ) -> list[SandboxResult]:
    """Run jobs in one child until they are done or one kills it; at least one result comes back."""
    with tempfile.TemporaryDirectory(prefix="rlflow-sandbox-") as cwd, tempfile.TemporaryFile() as stderr, \
            child_cgroups(PROCESS_CAP, limits.memory_mb) as enter:
        try:
            proc = subprocess.Popen(
                [*enter, *child_command(limits, readable)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=cwd,
                env={"PATH": os.defpath},
                start_new_session=True,
            )
        except OSError as err:
            raise RewardError(f"the reward sandbox could not start {sys.executable}: {err}") from err
        lines: queue.Queue[bytes | None] = queue.Queue()
        reader = threading.Thread(target=pump_lines, args=(proc.stdout, lines), daemon=True)
        reader.start()
        try:
            _await_ready(proc, lines, stderr, limits)
            return _collect(proc, jobs, lines, limits)
        finally:
            kill_child(proc)
            reader.join(timeout=5)


BWRAP = "bwrap"
_warned: set[str] = set()  # the one-line warnings given in this process (tools run in threads: under a lock)
_warned_lock = threading.Lock()
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_cgroups = itertools.count()


def _warn_once(message: str) -> None:
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    log.warning(message)


@contextlib.contextmanager
def child_cgroups(processes: int, memory_mb: int) -> Iterator[list[str]]:
    """cgroups of its own for one child (one episode, or one batch of jobs): a pids cgroup capped at
    `processes` and a memory cgroup capped at `memory_mb` + MEMORY_SLACK_MB for all its processes together,
    their tmpfs files (its /tmp) included. Yields the command prefix that enters them before exec'ing the
    child (`sh -c`, so nothing runs between fork and exec in this process, which has threads); removed when
    the block ends. A cap no cgroup can hold here is left out, and one warning line says so."""
    name = f"rlflow-sandbox-{os.getpid()}-{next(_cgroups)}"
    pids = _make_cgroup("pids", {"pids.max": processes}, name)
    memory = _make_cgroup("memory", _memory_settings((memory_mb + MEMORY_SLACK_MB) << 20), name)
    if pids is None:
        _warn_once("the sandbox cannot cap how many processes a job starts here (no writable pids cgroup): only its "
                   "timeout bounds a fork bomb")
    if memory is None:
        _warn_once("the sandbox cannot cap the memory of a job's or an episode's processes together here (no "
                   "writable memory cgroup): each process has its own address-space cap, so N processes hold N "
                   "times it until the timeout")
    groups = list(dict.fromkeys(g for g in (pids, memory) if g is not None))  # cgroup v2: one group holds both
    try:
        if not groups:
            yield []
            return
        enter = 'while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 126; shift; done; shift; exec "$@"'
        yield ["/bin/sh", "-c", enter, "sh", *map(str, groups), "--"]
    finally:
        for group in groups:
            _remove_cgroup(group)


def _remove_cgroup(group: Path) -> None:
    for _ in range(50):  # the child's processes are killed already; the kernel lets go of them at once
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


def _memory_settings(limit: int) -> dict[str, int]:
    """The files that cap a memory cgroup at `limit` bytes, swap included where it is counted: cgroup v1's
    (memory.memsw.* exists only with swap accounting on; it must be at least the plain limit, so it comes
    second) or v2's."""
    if (_CGROUP_ROOT / "cgroup.controllers").exists() and not (_CGROUP_ROOT / "memory").is_dir():
        return {"memory.max": limit, "memory.swap.max": 0}
    return {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit}


def _make_pids_cgroup(limit: int) -> Path | None:
    """A pids cgroup capped at `limit` processes (see _make_cgroup), or None."""
    return _make_cgroup("pids", {"pids.max": limit}, f"rlflow-sandbox-{os.getpid()}-{next(_cgroups)}")


def _make_cgroup(controller: str, settings: dict[str, int], name: str) -> Path | None:
    """A cgroup `name` under this process's own in the `controller` hierarchy (v1), or in the unified one
    (v2) where the controller is delegated to it, with each of `settings` written (a file the kernel does
    not offer, such as swap's without swap accounting, is left out; the first one must exist); None where
    that cannot be done. In v2 the group of another controller of the same child is reused (a process is
    in one v2 cgroup)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    bases = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            bases.append(_CGROUP_ROOT / controller / path.lstrip("/"))
        elif controllers == "" and (_CGROUP_ROOT / "cgroup.controllers").exists():  # a v2-only machine
            bases.append(_CGROUP_ROOT / path.lstrip("/"))
    first = next(iter(settings))
    for base in bases:
        group, made = base / name, False
        try:
            group.mkdir()
            made = True
        except FileExistsError:
            pass  # v2: this child's group, made for another controller
        except OSError:
            continue
        try:
            if (group / first).exists():  # made by the kernel: a cgroup with this controller, not a plain folder
                for file, value in settings.items():
                    if file == first or (group / file).exists():
                        with open(group / file, "w") as handle:
                            handle.write(f"{value}\n")
                return group
        except OSError:
            pass
        if made:
            with contextlib.suppress(OSError):
                group.rmdir()
    return None


def bwrap_available() -> bool:
    return shutil.which(BWRAP) is not None


def child_command(limits: SandboxLimits, readable: Sequence[str] = ()) -> list[str]:
    """The sandbox child's command line. isolation "bwrap": in Debian's bubblewrap, with new user, PID,
    network, IPC and UTS namespaces (no network at all, no other process visible), only the files the child
    needs shown, read-only (`file_view`: this interpreter, its environment, rlflow's engine, `readable`), a
    private /tmp, no capabilities, and the namespace ended with the child."""
    cpu_s = int(limits.timeout_s) + 2  # a job's CPU seconds: its wall clock bounds it first
    return confined([sys.executable, "-I", "-c", _CHILD, str(limits.memory_mb * 2**20), str(RESULT_CAP),
                     str(FILE_CAP), str(cpu_s)], limits, readable)


def confined(child: list[str], limits: SandboxLimits, readable: Sequence[str] = ()) -> list[str]:
    """`child` (a command line) as the sandbox runs it: in bubblewrap as `child_command` says, or as it is
    under isolation "none" (one warning line)."""
    if limits.isolation == "none":
        _warn_once("reward.sandbox.isolation=none: code the model writes or calls runs as this user, unconfined "
                   "(only its timeout and its memory and process caps apply)")
        return child
    if not bwrap_available():
        raise RewardError("code a model writes runs only in bubblewrap, and bwrap is not installed: install it "
                          "(apt-get install bubblewrap), or set reward.sandbox.isolation=none to run it unconfined")
    # --as-pid-1: no bubblewrap process inside the namespace (it would hold the pipe to this process, open
    # to a job through /proc/1/fd); the runner is the namespace's init, and all of it ends with it
    return [BWRAP, "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL",
            *file_view(readable), "--chdir", "/tmp", "--clearenv", "--setenv", "PATH", os.defpath, "--", *child]


# What the sandbox shows of this machine's files. It binds, read-only, only what the child needs: the
# system's programs and libraries, the few files of /etc that the loader and the C library read, this
# interpreter and its environment (sys.prefix, sys.base_prefix: a venv or a pyenv under the home folder is
# shown, the home folder is not), the child's import path, rlflow's engine package, and `readable` (a
# tool's, an environment's or an agent's own file or package, an agent's socket). Binding / and hiding the
# secrets we know of (a tmpfs over the home folder, the state folder, ~/.aws) would show whatever that list
# forgets: another tool's credentials, a new token file, another run's local storage, another user's
# world-readable files; a list of what is shown fails closed instead (a file it forgets is missing, and the
# child says so). Running as another user would not do: rlflow's own files are 0600 for its user, and root
# reads any file. Where a secret folder lies inside a shown one (a state folder inside the venv), an empty
# tmpfs hides it.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group", "nsswitch.conf",
             "alternatives", "ssl/certs", "ssl/openssl.cnf", "mime.types")  # not ssl/private, not shadow
# Secrets by their usual place (~ expanded) or the variable that names them; hidden where a shown folder
# holds them. The home folder itself is one: only the paths under it that are needed are shown.
SECRET_PATHS = ("~", "~/.rlflow", "~/.aws", "~/.ray", "~/.prefect", "~/.config", "~/.ssh", "~/.netrc")
SECRET_VARIABLES = ("RLFLOW_HOME", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                    "RAY_AUTH_TOKEN_PATH", "PREFECT_HOME", "GOOGLE_APPLICATION_CREDENTIALS")


def file_view(readable: Sequence[str] = ()) -> list[str]:
    """bubblewrap's arguments for the child's file system: the system folders and /etc's files as they
    are, a private /tmp, /proc and /dev of its own, then (outer folders first) what the child needs and the
    secrets inside it hidden, and the root made read-only."""
    args = []
    for folder in SYSTEM_DIRS:  # /bin and /lib are links into /usr on a merged-/usr system: kept as links
        if os.path.islink(folder):
            args += ["--symlink", os.readlink(folder), folder]
        elif os.path.isdir(folder):
            args += ["--ro-bind", folder, folder]
    for name in ETC_FILES:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    args += ["--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev"]
    binds = _needed(readable)  # (source, where it is shown)
    shown = [where for _, where in binds] + [f for f in SYSTEM_DIRS if not os.path.islink(f)]
    masks = sorted({p for p in _secrets() if any(_under(p, s) for s in shown)})
    # a needed path inside another is bound again only where a mask between them would hide it
    binds = [(src, where) for src, where in binds
             if not any(where != other and _under(where, other) for other in shown) or
             any(_under(where, m) for m in masks)]
    steps = [(where.count("/"), 0, ["--ro-bind", src, where]) for src, where in binds]
    steps += [(m.count("/"), 1, ["--tmpfs", m] if os.path.isdir(m) else ["--ro-bind", "/dev/null", m])
              for m in masks]
    for _, _, step in sorted(steps, key=lambda s: (s[0], s[1])):  # outer first; at one path, the mask last
        args += step
    return args + ["--remount-ro", "/"]


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _needed(readable: Sequence[str]) -> list[tuple[str, str]]:
    """(real path, path the child uses) of each thing the child needs that exists, beyond the system's."""
    wanted = [sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)),
              str(Path(__file__).resolve().parents[1]), *_import_path(), *readable]
    binds: dict[str, str] = {}
    for path in wanted:
        shown, real = os.path.abspath(path), os.path.realpath(path)
        if not os.path.exists(real) or any(_under(real, f) for f in SYSTEM_DIRS if not os.path.islink(f)):
            continue
        binds[real] = real
        binds[shown] = real  # a link's own path, as the child names it (a venv's bin/python, a tool's file)
    return sorted((src, where) for where, src in binds.items())


def _secrets() -> list[str]:
    """The secret paths of this process's user (each as given and as it really is)."""
    named = [os.path.expanduser(p) for p in SECRET_PATHS]
    named += [os.path.expanduser(os.environ[v]) for v in SECRET_VARIABLES if os.environ.get(v)]
    found = set()
    for path in named:
        if path != "/" and os.path.exists(path):
            found.update({os.path.abspath(path), os.path.realpath(path)})
    return sorted(found)


@functools.lru_cache(maxsize=1)
def _import_path() -> tuple[str, ...]:
    """What the child imports from beyond its environment's folders: the entries its own sys.path gets from
    .pth files (a project installed in place, another environment's site-packages, an egg). Of a folder
    that is not a site-packages (a checkout, with ./runs beside its packages) only its packages and modules
    are shown."""
    try:
        out = subprocess.run([sys.executable, "-I", "-c", "import json, sys; print(json.dumps(sys.path))"],
                             capture_output=True, env={"PATH": os.defpath}, timeout=_STARTUP_TIMEOUT_S, check=True)
        entries = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return ()
    found = []
    for entry in entries:
        if not isinstance(entry, str) or not os.path.exists(entry) or any(
                _under(os.path.realpath(entry), os.path.realpath(p)) for p in (sys.prefix, sys.base_prefix)):
            continue
        if os.path.isfile(entry) or os.path.basename(entry) in ("site-packages", "dist-packages"):
            found.append(entry)
            continue
        for name in sorted(os.listdir(entry)):
            member = os.path.join(entry, name)
            if name.endswith((".py", ".so")) or os.path.isfile(os.path.join(member, "__init__.py")):
                found.append(member)
    return tuple(found)


def shown_files(ref: str) -> list[str]:
    """What the sandbox shows of the code `ref` names ('path/to/file.py:name' or 'module:name'): the file,
    or the top-level package (or module) the module is found in from here; none when it is not found (the
    child's own import then says so)."""
    target = ref.rpartition(":")[0]
    if target.endswith(".py"):
        return [target]
    try:
        spec = importlib.util.find_spec(target.split(".")[0]) if target else None
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)
    return [spec.origin] if spec.origin and os.path.isfile(spec.origin) else []


def _await_ready(
    proc: subprocess.Popen[bytes], lines: queue.Queue[bytes | None], stderr: IO[bytes], limits: SandboxLimits
) -> None:
    try:
        line = lines.get(timeout=_STARTUP_TIMEOUT_S)
    except queue.Empty:
        line = None
    if line is not None and line.strip() == b'{"ready": true}':
        return
    kill_child(proc)
    stderr.seek(0)
    tail = stderr.read().decode(errors="replace").strip().splitlines()[-3:]
    raise RewardError(
        f"the reward sandbox could not start (exit code {proc.returncode}, sandbox_memory_mb="
        f"{limits.memory_mb}): {' | '.join(tail) or 'no output'}; raise reward.sandbox_memory_mb if it is tiny"
    )


def _collect(
    proc: subprocess.Popen[bytes],
    jobs: Sequence[SandboxJob],
    lines: queue.Queue[bytes | None],
    limits: SandboxLimits,
) -> list[SandboxResult]:
    results: list[SandboxResult] = []
    assert proc.stdin is not None
    for job in jobs:
        start = time.monotonic()  # each job's clock starts when it is sent
        try:
            proc.stdin.write(json.dumps(asdict(job)).encode() + b"\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass  # the child died: the read below says so
        try:
            line = lines.get(timeout=limits.timeout_s)
        except queue.Empty:
            kill_child(proc)
            elapsed = time.monotonic() - start
            return results + [
                SandboxResult("timeout", detail=f"killed after {elapsed:.2f} s", elapsed_s=elapsed)
            ]
        elapsed = time.monotonic() - start
        record = _parse(line)
        if record is None:  # the child died mid-job
            kill_child(proc)
            detail = f"the interpreter exited with code {proc.returncode}" if line is None else "bad output"
            return results + [SandboxResult("crashed", detail=detail, elapsed_s=elapsed)]
        results.append(
            SandboxResult(record["status"], record.get("value"), record.get("detail", ""), elapsed)
        )
    return results


def _parse(line: bytes | None) -> dict[str, Any] | None:
    if line is None:
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(record, dict) and record.get("status") in ("ok", "error", "memory", "crashed")
    return record if ok else None


def pump_lines(stream: IO[bytes], lines: queue.Queue[bytes | None]) -> None:
    for line in iter(lambda: stream.readline(RESULT_CAP + 4096), b""):  # the runner caps a result already
        lines.put(line)
    lines.put(None)  # end of output: the child exited or was killed


def kill_child(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child and anything it started (its own session), then reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
