"""Where the CPU time of a command goes, by kind of process: a sample of /proc once a second.

    python bench/cpu_by_process.py --out cpu.json -- python -m pytest -q

Runs the command, and while it runs reads every process's user + system time once a second; each
process's time is added to the kind its command line names now (Ray renames a worker when it takes a
task: `ray::IDLE` while it starts and waits, `ray::generate_rollouts` while it runs one). Written to
--out every 30 s and at the end: CPU seconds per kind, the machine's busy and idle seconds, and how much
of the time spent as `ray::IDLE` went to workers that never ran anything (a worker's start is spent
under that title too, so a worker that later ran a task counts as used).

A process that starts and ends between two samples is not seen (its time is in no kind); one started
after the command counts all the time it used before its first sample; what ran before is not counted. docs/testing.md has the figures of a whole suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")
KINDS = (  # (what the command line contains, kind): the first match wins
    ("mypy", "mypy"), ("chrom", "chromium"), ("infra.s3server", "s3 server"), ("prefect server", "prefect server"),
    ("uvicorn", "prefect server"), ("prefect.engine", "prefect flow run process"), ("ray::", "ray::"),
    ("default_worker", "ray worker (starting)"), ("gcs_server", "ray gcs"), ("raylet", "ray raylet"),
    ("log_monitor", "ray log monitor"), ("dashboard", "ray dashboard agent"), ("runtime_env", "ray runtime-env agent"),
    ("monitor.py", "ray monitor"), ("warm_cli", "warm cli"), ("flows.cli", "rlflow cli"), ("bin/rlflow", "rlflow cli"),
    ("bwrap", "sandbox"), ("wandb", "wandb"), ("exec(eval(sys.stdin", "pytest worker"), ("pytest", "pytest"),
)


def kind(cmdline: str) -> str:
    for needle, name in KINDS:
        if needle in cmdline:
            return "ray::" + cmdline.split("ray::", 1)[1].split()[0][:40] if name == "ray::" else name
    return "other: " + cmdline[:50] if cmdline else "kernel"


def machine_busy_idle() -> tuple[int, int]:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], ticks[3] + ticks[4]


class Sampler:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.seen: dict[tuple[str, str], int] = {}  # (pid, start time) -> ticks at the last sample
        self.by_kind: dict[str, float] = {}
        self.idle_ticks: dict[tuple[str, str], int] = {}  # ticks spent as ray::IDLE or starting, per worker
        self.used: set[tuple[str, str]] = set()  # workers seen running something
        self.first = machine_busy_idle()
        self.stop = threading.Event()
        self.sample(count=False)  # what ran before the command is not counted


    def sample(self, count: bool = True) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{pid}/cmdline") as f:
                    cmdline = f.read().replace("\0", " ").strip()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            ticks, key = int(fields[11]) + int(fields[12]), (pid, fields[19])
            delta = ticks - self.seen.get(key, 0)
            self.seen[key] = ticks
            if not count:
                continue
            name = kind(cmdline)
            self.by_kind[name] = self.by_kind.get(name, 0.0) + delta / HZ
            if name in ("ray::IDLE", "ray worker (starting)"):
                self.idle_ticks[key] = self.idle_ticks.get(key, 0) + delta
            elif name.startswith("ray::"):
                self.used.add(key)

    def write(self) -> None:
        busy, idle = machine_busy_idle()
        unused = sum(t for k, t in self.idle_ticks.items() if k not in self.used) / HZ
        report = {
            "machine_busy_s": (busy - self.first[0]) / HZ, "machine_idle_s": (idle - self.first[1]) / HZ,
            "idle_workers_never_used": {"count": len(set(self.idle_ticks) - self.used), "cpu_s": round(unused, 1)},
            "cpu_s_by_kind": {k: round(v, 1) for k, v in sorted(self.by_kind.items(), key=lambda kv: -kv[1])},
        }
        self.out.write_text(json.dumps(report, indent=1) + "\n")

    def run(self) -> None:
        last = time.monotonic()
        while not self.stop.wait(1.0):
            self.sample()
            if time.monotonic() - last > 30:
                self.write()
                last = time.monotonic()
        self.sample()
        self.write()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON report")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    sampler = Sampler(args.out)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    try:
        code = subprocess.call(command)
    finally:
        sampler.stop.set()
        thread.join()
    print(f"cpu_by_process: {args.out}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
