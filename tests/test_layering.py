"""The package's layering, tested rather than hoped for (static ``ast`` walks of every import, module-level and
inside functions; imports under ``if TYPE_CHECKING:`` never run and are left out):

- the rollout process's modules import no torch (it is CPU-only and spawned; ``rollout/process.py``);
- nothing in ``train/ rollout/ sync/ server/`` imports ``asyncgrpo_cli.embedded`` (the server that answers is not
  the client that asks);
- ``config/`` imports no torch and nothing from ``model/`` or ``sync/`` (``asyncgrpo check`` stays light);
- the package has no import cycle.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import asyncgrpo_cli

PKG = "asyncgrpo_cli"
ROOT = Path(asyncgrpo_cli.__file__).resolve().parent


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    """A module of the package (``asyncgrpo_cli.x.y``) or the top-level name of another distribution (``torch``)."""
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = "in a function" if self.in_function else "module level"
        return f"{self.source} -> {self.target} (line {self.line}, {where})"


@cache
def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PKG, *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(nodes: list[ast.stmt] | list[ast.AST], in_function: bool = False):
    """``(node, in_function)`` for every import that can run: ``if TYPE_CHECKING:`` bodies are skipped."""
    for node in nodes:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _runtime_imports(node.orelse, in_function)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _runtime_imports(list(ast.iter_child_nodes(node)), nested)


def _target(name: str) -> str:
    """The deepest module of the package that ``name`` names (``a.b.func`` -> ``a.b``), or the distribution."""
    if name != PKG and not name.startswith(PKG + "."):
        return name.split(".")[0]
    while name not in modules():
        name = name.rsplit(".", 1)[0]
    return name


@cache
def edges(source: str) -> tuple[Edge, ...]:
    path = modules()[source]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = source if path.name == "__init__.py" else source.rsplit(".", 1)[0]
    out = []
    for node, in_function in _runtime_imports(tree.body):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        for name in names:
            target = _target(name)
            if target != source:
                out.append(Edge(source, target, node.lineno, in_function))
    return tuple(dict.fromkeys(out))


def reachable(start: list[str]) -> dict[str, Edge | None]:
    """Every package module the ``start`` modules import, directly or not, with the edge that first reached it."""
    seen: dict[str, Edge | None] = dict.fromkeys(start)
    todo = list(start)
    while todo:
        for e in edges(todo.pop()):
            if e.target in modules() and e.target not in seen:
                seen[e.target] = e
                todo.append(e.target)
    return seen


def chain(seen: dict[str, Edge | None], end: str) -> str:
    links = []
    while (e := seen[end]) is not None:
        links.append(str(e))
        end = e.source
    return "; ".join(reversed(links))


def under(*folders: str) -> list[str]:
    prefixes = tuple(f"{PKG}.{f}" for f in folders)
    return [m for m in modules() if m in prefixes or m.startswith(tuple(p + "." for p in prefixes))]


def torch_imports(start: list[str]) -> list[str]:
    """``torch`` imports reachable from ``start``, each with the import chain that reaches it."""
    seen = reachable(start)
    return [
        f"{chain(seen, m)}; {e}" if seen[m] else str(e) for m in seen for e in edges(m) if e.target == "torch"
    ]


# -- the rules ------------------------------------------------------------------------------------------------------
ROLLOUT_CHILD = [
    f"{PKG}.rollout.child",
    f"{PKG}.rollout.worker",
    f"{PKG}.rollout.process",
    f"{PKG}.rollout.loop",
    f"{PKG}.rollout.rewards",
    f"{PKG}.rollout.scorers.grpo",
    f"{PKG}.rewards",
]
"""What the spawned rollout process runs: its entry, the default loop, scoring and the built-in rewards."""


def test_the_walk_sees_imports_at_every_level():
    found = {(e.target, e.in_function) for e in edges(f"{PKG}.rollout.process")}
    assert (f"{PKG}.rollout.resync", False) in found
    found = {(e.target, e.in_function) for e in edges(f"{PKG}.rollout.worker")}
    assert (f"{PKG}.rollout.rewards", True) in found
    assert ("transformers", True) in found


def test_rollout_process_imports_no_torch():
    start = ROLLOUT_CHILD + under("rollout", "rewards")
    assert torch_imports(start) == []


def test_rollout_process_imports_no_torch_when_run():
    """What the child imports before its loop runs, in a fresh interpreter: no torch module gets loaded. (The
    tokenizer's ``transformers`` import does load torch; that is the library's, not ours, and is left out.)"""
    code = (
        "import sys\n"
        "import asyncgrpo_cli.rollout.process\n"
        "from asyncgrpo_cli import registry\n"
        "from asyncgrpo_cli.rollout.rewards import load_reward_funcs\n"
        "registry.resolve('rollout_loop', 'default')\n"
        "load_reward_funcs(registry.names('reward'))\n"
        "for name in registry.names('dataset'):\n"
        "    registry.resolve('dataset', name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_client_side_imports_no_embedded_server():
    bad = [
        str(e)
        for m in under("train", "rollout", "sync", "server")
        for e in edges(m)
        if e.target == f"{PKG}.embedded" or e.target.startswith(f"{PKG}.embedded.")
    ]
    assert bad == []


def test_config_imports_no_torch_and_no_model_or_sync():
    config = under("config")
    bad = [
        str(e)
        for m in config
        for e in edges(m)
        if e.target == "torch" or e.target.startswith((f"{PKG}.model", f"{PKG}.sync"))
    ]
    assert bad == []
    assert torch_imports(config) == []


def find_cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative). A package's ``__init__``
    and its own submodules are one unit: importing ``a.b`` runs ``a/__init__`` first, which is no cycle."""
    graph = {
        m: sorted(
            {
                e.target
                for e in edges(m)
                if e.target in modules()
                and not e.target.startswith(m + ".")
                and not m.startswith(e.target + ".")
            }
        )
        for m in modules()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_search_finds_a_cycle(monkeypatch):
    a, b = f"{PKG}.registry", f"{PKG}.errors"
    real = edges

    def fake(source: str) -> tuple[Edge, ...]:
        extra = {a: Edge(a, b, 1, False), b: Edge(b, a, 1, True)}
        return real(source) + ((extra[source],) if source in extra else ())

    monkeypatch.setattr(sys.modules[__name__], "edges", fake)
    assert sorted([a, b]) in find_cycles()


def test_no_import_cycle():
    cycles = find_cycles()
    detail = [[str(e) for m in c for e in edges(m) if e.target in c] for c in cycles]
    assert cycles == [], detail
