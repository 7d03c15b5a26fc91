"""The layers import in one direction (README "Layout"): flows/ may import everything; tasks/ imports
the engine and infra, never flows/; engine/ never imports Prefect, infra/, tasks/ or flows/; infra/ imports
nothing of the engine but engine.batch (the records it stores). Every import statement counts, at
any depth in a file (a function-level import crosses a layer as much as a top-level one)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def imports_of(package: str) -> list[tuple[str, str]]:
    """(file relative to the repository, imported module) for every absolute import in `package`; a
    `from a import b` counts as importing both `a` and `a.b` (b may be a module)."""
    return [(str(path.relative_to(REPO)), module) for path in sorted((REPO / package).rglob("*.py"))
            for module in imports_in(path)]


def imports_in(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return found


def top(module: str) -> str:
    return module.split(".")[0]


def test_engine_never_imports_prefect_infra_tasks_or_flows() -> None:
    found = imports_of("engine")
    assert len(found) > 100  # the walk saw the engine's files
    assert [(f, m) for f, m in found if top(m) in {"prefect", "prefect_ray", "infra", "tasks", "flows"}] == []


def test_infra_imports_only_engine_batch_of_the_engine() -> None:
    found = imports_of("infra")
    assert ("infra/buffers.py", "engine.batch") in found
    assert [(f, m) for f, m in found if top(m) in {"tasks", "flows"}
            or (top(m) == "engine" and m != "engine.batch" and not m.startswith("engine.batch."))] == []


def test_tasks_never_import_flows() -> None:
    assert [(f, m) for f, m in imports_of("tasks") if top(m) == "flows"] == []


def test_only_flows_and_the_demo_itself_import_the_demo() -> None:
    """engine/demo (the project's own tiny models and synthetic data) is called by flows/ and the CLI: the rest
    of the engine, tasks/ and infra/ never import it, so "tiny" and the synthetic files reach the engine as
    directories and files resolved by the flows layer."""
    demo = [(f, m) for package in ("engine", "tasks", "infra") for f, m in imports_of(package)
            if (m == "engine.demo" or m.startswith("engine.demo.")) and not f.startswith("engine/demo/")]
    assert demo == []
    assert [(f, m) for f, m in imports_of("engine/demo") if top(m) in {"tasks", "flows", "infra", "prefect"}] == []


def module_graph() -> dict[str, set[str]]:
    """Every module of the four packages -> the modules of the four packages it imports (any depth in the
    file, type-checking imports too); a module's own parent packages are left out."""
    files = {}
    for package in LAYERS:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            files[name] = path

    def owner(module: str) -> str:
        while module and module not in files:
            module = module.rpartition(".")[0]
        return module

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = {owner(m) for m in imports_in(path)}
        graph[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                circles.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


LAYERS = ("engine", "infra", "tasks", "flows")


def test_no_two_modules_import_each_other() -> None:
    """No import circle, however long, among the modules of flows/, tasks/, infra/ and engine/ (the tiny
    builder and the model loader, the node and the stack, a stage's context and its faults were three)."""
    graph = module_graph()
    assert {"engine.models.loading", "infra.stack", "tasks.context"} <= set(graph)
    assert "engine.models.loading" in graph["engine.demo.tiny"]  # the walk sees the edges
    assert import_circles(graph) == []
    assert import_circles({**graph, "engine.models.loading": {"engine.demo.tiny"}}) != []  # it can fail


@pytest.mark.parametrize("run_id", ["a", "run-1", "A.b_c-9", "x" * 128, "", "-a", ".a", "a/b", "a\n", "x" * 129,
                                    "a b", "é", "../etc"])
def test_storage_and_the_engine_accept_the_same_run_ids(run_id: str) -> None:
    """infra.layout and engine.workers.group each keep the run-id rule (infra may not import the
    engine's config): a run that storage accepts can always name its actors, and the other way round."""
    from engine.errors import EngineError
    from engine.workers import group
    from infra import layout
    from infra.errors import StoreError

    assert layout.RUN_ID.pattern == group.RUN_ID.pattern

    def accepted(check, error: type[Exception]) -> bool:  # noqa: ANN001
        try:
            check(run_id)
        except error:
            return False
        return True

    by_storage = accepted(layout.check_run_id, StoreError)
    assert by_storage == accepted(group.check_run_id, EngineError)
    assert by_storage == (run_id in {"a", "run-1", "A.b_c-9", "x" * 128})


def test_a_tool_module_loads_without_torch() -> None:
    """A tool call's sandbox child imports the tool's module under an address-space cap
    (rollout.multi_turn.tool_memory_mb): engine/rollout/__init__.py must not pull in torch."""
    import subprocess
    import sys

    code = "import sys, engine.rollout.builtin_tools; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("module", ["engine.rollout.builtin_envs", "engine.rollout.builtin_agents"])
def test_an_environment_or_agent_module_loads_without_torch_or_pydantic(module: str) -> None:
    """Every episode's sandbox child imports its environment's or agent's module (rollout.env, rollout.agent),
    once per episode: the builtin ones cost no torch and no config models."""
    import subprocess
    import sys

    code = f"import sys, {module}; print(sorted({{'torch', 'pydantic'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
