"""User code named in the config: `module:name` (importable) or `path/to/file.py:name`."""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import os
import threading
from typing import Any

from engine.errors import RLFlowError

# Modules that moved when engine/ was grouped by role: a `module:name` spec written before names the old
# module. run.json and deployments keep the specs they were given, so these resolve to the new one.
MOVED = {"engine.builtin_tools": "engine.rollout.builtin_tools", "engine.tools": "engine.rollout.tools"}


_PARSE_LOCK = threading.Lock()
_RACE = "AST constructor recursion depth mismatch"


def parse_module(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse`, safe beside other threads. CPython 3.11 keeps the AST constructor's recursion depth
    in interpreter-wide state, and in a threaded process a parse can fail with "SystemError: AST
    constructor recursion depth mismatch" although the source is fine (python/cpython#106905; seen once
    here, in a deployed run's flow process checking its config's file references). Our own parses take
    turns; one that still fails so is parsed again, twice at most: that error says nothing of the
    source."""
    with _PARSE_LOCK:
        for _ in range(2):
            try:
                return ast.parse(source, filename)
            except SystemError as err:
                if _RACE not in str(err):
                    raise
        return ast.parse(source, filename)


def canonical_spec(spec: str) -> str:
    """`spec` with a moved module (MOVED) named as it is now; any other spec as it is."""
    target, sep, name = spec.rpartition(":")
    return f"{MOVED[target]}{sep}{name}" if sep and target in MOVED else spec


@functools.lru_cache(maxsize=32)
def load_object(spec: str, setting: str, error: type[RLFlowError] = RLFlowError, kind: str = "function") -> Any:
    """The `kind` (a function, by default) `name` of `module` or of the file, imported once per process;
    `error` names `setting` and says what is wrong (bad form, missing module or file, failing import,
    no such name). A function must be callable."""
    target, sep, name = canonical_spec(spec).rpartition(":")
    if not sep or not target or not name:
        raise error(f"{setting} must be 'module:{kind}' or 'path/to/file.py:{kind}', got {spec!r}")
    module = _import_file(target, spec, setting, error) if target.endswith(".py") or os.sep in target \
        else _import_module(target, spec, setting, error)
    found = getattr(module, name, None)
    if found is None or (kind == "function" and not callable(found)):
        raise error(f"{setting} {spec!r}: {target} has no {kind} {name!r}")
    return found


def _import_module(target: str, spec: str, setting: str, error: type[RLFlowError]) -> Any:
    try:
        return importlib.import_module(target)
    except ImportError as err:
        raise error(f"{setting} {spec!r}: cannot import module {target!r} ({err})") from err


def _import_file(target: str, spec: str, setting: str, error: type[RLFlowError]) -> Any:
    path = os.path.abspath(target)
    if not os.path.isfile(path):
        raise error(f"{setting} {spec!r}: no such file {path}")
    # A name unique to the path, so two custom files with one stem never share a module.
    module_name = "rlflow_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    assert loader_spec is not None and loader_spec.loader is not None
    module = importlib.util.module_from_spec(loader_spec)
    try:
        loader_spec.loader.exec_module(module)
    except Exception as err:
        raise error(f"{setting} {spec!r}: importing {path} failed: {type(err).__name__}: {err}") from err
    return module
