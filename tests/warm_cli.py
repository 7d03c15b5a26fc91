"""`rlflow ...` commands run one after another in ONE long-lived process (flows.cli.main, as the
console script calls it), for tests/services.WarmCli: `python tests/warm_cli.py` reads one request per
line on stdin, `{"argv": [...], "env": {...}, "out": PREFIX}`, runs it with its output (file descriptors 1
and 2) in PREFIX.stdout / PREFIX.stderr, and answers `{"rc": N}` on its own stdout.

What this saves is the process's start: Python and the libraries' imports (~6 s), and above all the Ray
workers that run the stage tasks, which belong to the process's Ray job: a new process starts new ones
(~5 s of imports each, two per run), this one keeps them for every later run.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def serve() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # before any request takes fd 1
    from flows.cli import main

    for line in sys.stdin:
        request = json.loads(line)
        before = {key: os.environ.get(key) for key in request["env"]}
        os.environ.update(request["env"])
        saved = os.dup(1), os.dup(2)
        with open(request["out"] + ".stdout", "w") as out, open(request["out"] + ".stderr", "w") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            try:
                rc = main(request["argv"])
            except SystemExit as exit_:  # argparse
                rc = exit_.code if isinstance(exit_.code, int) else 1
            except BaseException:  # what an uncaught exception does to the console script: exit 1
                traceback.print_exc()
                rc = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
        for key, value in before.items():  # the request's own variables only: the stack's stay set
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        answers.write(json.dumps({"rc": rc}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(serve())
