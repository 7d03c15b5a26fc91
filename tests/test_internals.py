"""One test per private name of another package that rlflow uses (docs/internals.md): each fails with a
message naming the package, the name and our file to mend, so an upgrade that moves one is caught here."""

from __future__ import annotations

import inspect
from importlib.metadata import version

import pytest


def moved(package: str, name: str, ours: str) -> str:
    return (f"{package} {version(package)} no longer has {name}, which {ours} relies on: mend {ours} and "
            "docs/internals.md, or keep the range in pyproject.toml")


def test_prefect_ray_run_prefect_task() -> None:
    from prefect_ray import RayTaskRunner

    fn = inspect.getattr_static(RayTaskRunner, "_run_prefect_task", None)
    assert isinstance(fn, staticmethod), moved("prefect-ray", "RayTaskRunner._run_prefect_task (static)",
                                              "tasks/runner.py")
    params = inspect.signature(fn.__func__).parameters
    assert {"task", "task_run_id", "context", "parameters", "wait_for", "dependencies"} <= set(params), \
        moved("prefect-ray", "_run_prefect_task(task, task_run_id, context, parameters, ...)", "tasks/runner.py")


def test_prefect_settings_context_serialize() -> None:
    from prefect.context import SettingsContext

    ctx = SettingsContext.get()
    assert ctx is not None and callable(getattr(ctx, "serialize", None)), \
        moved("prefect", "SettingsContext.serialize", "tasks/runner.py")
    data = ctx.serialize()
    assert isinstance(data, dict) and SettingsContext(**data).settings == ctx.settings, \
        moved("prefect", "SettingsContext(**ctx.serialize())", "tasks/runner.py")


def test_prefect_settings_context_token() -> None:
    from prefect.context import SettingsContext

    ctx = SettingsContext(**SettingsContext.get().serialize())
    assert hasattr(ctx, "_token") and ctx._token is None, moved("prefect", "SettingsContext._token", "tasks/runner.py")
    with ctx:
        assert ctx._token is not None, moved("prefect", "SettingsContext._token (set when entered)", "tasks/runner.py")


def test_ray_auth_token_loader() -> None:
    from ray import _raylet

    assert hasattr(_raylet, "AuthenticationTokenLoader") and hasattr(_raylet, "Config"), \
        moved("ray", "ray._raylet.AuthenticationTokenLoader / Config", "infra/stack.py")
    assert callable(getattr(_raylet.AuthenticationTokenLoader, "instance", None)), \
        moved("ray", "AuthenticationTokenLoader.instance().reset_cache()", "infra/stack.py")


def test_ray_cluster_mode_constant() -> None:
    from ray._private import ray_constants

    assert hasattr(ray_constants, "ENABLE_RAY_CLUSTER"), \
        moved("ray", "ray._private.ray_constants.ENABLE_RAY_CLUSTER", "infra/stack.py")


def test_torch_dcp_fsspec_filesystem() -> None:
    from torch.distributed.checkpoint import _fsspec_filesystem

    for name in ("FsspecWriter", "FsspecReader"):
        assert hasattr(_fsspec_filesystem, name), moved("torch", f"dcp._fsspec_filesystem.{name}",
                                                        "engine/state/checkpoint_io.py")


def test_torch_dcp_nested_dict_set_element() -> None:
    from torch.distributed.checkpoint import _nested_dict

    assert callable(getattr(_nested_dict, "set_element", None)), \
        moved("torch", "dcp._nested_dict.set_element", "engine/state/checkpoint_io.py")
    target: dict = {"a": {"b": 0}}
    _nested_dict.set_element(target, ("a", "b"), 1)
    assert target == {"a": {"b": 1}}, moved("torch", "set_element(root, path, value)", "engine/state/checkpoint_io.py")


def test_torch_dcp_reader_and_planner_attributes(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    reader = dcp.FileSystemReader(str(tmp_path))
    for name in ("fs", "path", "load_id"):
        assert hasattr(reader, name), moved("torch", f"FileSystemReader.{name}", "engine/state/checkpoint_io.py")
    for name in ("create_stream", "concat_path", "rename"):
        assert callable(getattr(reader.fs, name, None)), moved("torch", f"dcp FileSystem.{name}",
                                                               "engine/state/checkpoint_io.py")
    source = inspect.getsource(DefaultLoadPlanner.load_bytes)
    for name in ("flatten_state_dict", "mappings", "original_state_dict"):
        assert name in source, moved("torch", f"DefaultLoadPlanner.{name} in load_bytes", "engine/state/checkpoint_io.py")


def test_torch_dcp_metadata_classes_are_allowed(tmp_path) -> None:
    """A real DCP .metadata unpickles with our allow-list (a new class in it would be refused)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from engine.state.checkpoint_io import _MetadataUnpickler

    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    optim.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=str(tmp_path))
    with open(tmp_path / ".metadata", "rb") as f:
        try:
            _MetadataUnpickler(f).load()
        except Exception as err:  # noqa: BLE001
            pytest.fail(moved("torch", f"the classes of DCP's .metadata ({err})", "engine/state/checkpoint_io.py"))


def test_torch_fsdp2_collective_names() -> None:
    import torch.distributed as dist

    for name in ("all_gather_single", "reduce_scatter_single"):
        assert hasattr(dist, name), moved("torch", f"torch.distributed.{name} (what FSDP2 calls)",
                                          "engine/workers/base.py collective_trace")


def test_s3fs_call_s3() -> None:
    import s3fs

    fn = getattr(s3fs.S3FileSystem, "_call_s3", None)
    assert fn is not None and inspect.iscoroutinefunction(fn), moved("s3fs", "S3FileSystem._call_s3 (async)",
                                                                     "infra/store.py")
