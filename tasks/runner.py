"""The iteration flow's task runner: prefect-ray's RayTaskRunner with Prefect's per-task setup made cheap.

Every stage task carries the flow's Prefect settings to its Ray worker (prefect-ray serializes the
whole settings model on each submit, and the worker validates it back into a new `Settings` on each
run), and Prefect's task engine opens a new API client per task, whose TLS context loads the CA
bundle even when the API is plain HTTP. Profiled on the W2 benchmark step (2 cores): ~40 ms of
serializing on the flow side and ~90 ms of settings and clients on the worker side per task, ~0.5 s
of a 3 s iteration with four stage tasks.

This runner keeps Prefect's behaviour and cuts the repetition:
- flow side: the settings are serialized once per settings object instead of once per submit;
- worker side: the settings are validated once per distinct settings payload per worker process,
  and the task gets one API client (both of the task engine's lookups find it); for a plain-HTTP API
  its unused TLS context is built once per process.
The task engine, states, results, caching and retries are Prefect's own, unchanged.
"""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import cache
from typing import Any

from prefect.client.orchestration import get_client
from prefect.context import SettingsContext, SyncClientContext
from prefect.settings import PREFECT_API_URL
from prefect_ray import RayTaskRunner

_SETTINGS_CACHE_SIZE = 4
_worker_settings: dict[str, SettingsContext] = {}
_lock = threading.Lock()


class StageTaskRunner(RayTaskRunner):  # type: ignore[misc]
    """RayTaskRunner whose tasks pay Prefect's settings and client setup once, not per task."""

    def submit(self, task: Any, parameters: dict[str, Any], wait_for: Any = None, dependencies: Any = None) -> Any:
        current = SettingsContext.get()
        if current is None:
            return super().submit(task, parameters, wait_for, dependencies)
        with _serialize_as(current, _serialized(current)):
            return super().submit(task, parameters, wait_for, dependencies)

    @staticmethod
    def _run_prefect_task(*upstream_ray_obj_refs: Any, task: Any, task_run_id: Any, context: dict[str, Any],
                          parameters: dict[str, Any], wait_for: Any = None, dependencies: Any = None) -> Any:
        context = dict(context)
        settings = context.pop("settings_context", None)
        with ExitStack() as stack:
            if settings:
                stack.enter_context(_settings_context(settings))
            stack.enter_context(_task_client())
            return RayTaskRunner._run_prefect_task(
                *upstream_ray_obj_refs, task=task, task_run_id=task_run_id, context=context, parameters=parameters,
                wait_for=wait_for, dependencies=dependencies)  # fmt: skip


_last_serialized: tuple[Any, Any, dict[str, Any]] | None = None  # (settings, profile, serialization)


def _serialized(ctx: SettingsContext) -> dict[str, Any]:
    """`ctx.serialize()`, recomputed only when the settings or profile object changes (Prefect makes a
    new settings object for every change: `temporary_settings`, `copy_with_update`)."""
    global _last_serialized
    last = _last_serialized
    if last is None or last[0] is not ctx.settings or last[1] is not ctx.profile:
        last = _last_serialized = (ctx.settings, ctx.profile, ctx.serialize())
    return last[2]


@contextmanager
def _serialize_as(target: SettingsContext, data: dict[str, Any]) -> Iterator[None]:
    """`target.serialize()` returns `data` (already computed) while inside; other contexts are untouched."""
    original = SettingsContext.serialize

    def serialize(self: SettingsContext, include_secrets: bool = True) -> dict[str, Any]:
        if self is target and include_secrets:
            return data
        return original(self, include_secrets=include_secrets)

    with _lock:
        SettingsContext.serialize = serialize  # type: ignore[method-assign]
        try:
            yield
        finally:
            SettingsContext.serialize = original  # type: ignore[method-assign]


@contextmanager
def _settings_context(serialized: dict[str, Any]) -> Iterator[None]:
    """The flow's settings in this worker, validated once per distinct payload."""
    key = json.dumps(serialized, sort_keys=True, default=str)
    ctx = _worker_settings.get(key)
    if ctx is None or ctx._token is not None:  # not cached, or entered by a concurrent task
        ctx = SettingsContext(**serialized)
        if len(_worker_settings) >= _SETTINGS_CACHE_SIZE:
            _worker_settings.clear()
        _worker_settings[key] = ctx
    with ctx:
        yield


@contextmanager
def _task_client() -> Iterator[None]:
    """One Prefect API client for the task (the task engine's own lookups find and reuse it)."""
    if SyncClientContext.get() is not None:
        yield
        return
    api = str(PREFECT_API_URL.value() or "")
    if api.startswith("http://"):
        # Plain HTTP: no TLS happens, but the client would still load the CA bundle (~20 ms).
        client = get_client(sync_client=True, httpx_settings={"verify": _unused_tls_context()})
        ctx = SyncClientContext.model_construct(client=client)
    else:
        ctx = SyncClientContext()
    with ctx:
        yield


@cache
def _unused_tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()
