"""The shape ARCHITECTURE.md promises: one-way arrows between the three packages, no import cycle
among the project's modules (lazy imports inside functions count), a small ``wbridge/`` top level,
and pipeline stages that talk to the roles through their typed contexts, never their privates.
Modules are split by idea, not by size: no line cap."""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("wbridge", "planner", "transports")
FORBIDDEN = {"planner": {"wbridge", "transports"}, "transports": {"wbridge", "planner"}}
TOP_LEVEL_MAX = 18  # modules and packages directly under wbridge/
# a role's private attributes, touched from outside its own module: e.g. ``sub._store``
REACH_IN = re.compile(r"\b(sub|subscriber|self\._sub|pub|publisher|self\._pub)\._[a-z]")


def _modules() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[mod.removesuffix(".__init__")] = path
    return out


def _imports(mod: str, path: str, known: set[str]) -> set[str]:
    """Project modules that ``mod`` imports anywhere in its body (module level or lazily)."""
    is_pkg = path.endswith("__init__.py")
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out: set[str] = set()

    def add(name: str) -> None:
        # the deepest project module the name refers to (``a.b.c`` may be a name inside ``a.b``)
        parts = name.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        if parts:
            out.add(".".join(parts))

    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[: len(base) - (node.level - 1)]
                target = ".".join(prefix + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                full = f"{target}.{a.name}"
                add(full if full in known else target)
    out.discard(mod)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) for m, p in mods.items()}


def test_layers_point_one_way():
    bad = [
        (m, d) for m, deps in _graph().items() for d in deps if d.split(".")[0] in FORBIDDEN.get(m.split(".")[0], ())
    ]
    assert not bad, f"imports against the layering rule: {bad}"


def test_no_import_cycles():
    graph = _graph()
    # a package's __init__ re-exporting its own submodules is not a cycle through them: drop the
    # edges from a package to its own children (children importing siblings still count)
    for m in graph:
        graph[m] = {d for d in graph[m] if not d.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_wbridge_top_level_is_small():
    top = [
        n
        for n in os.listdir(os.path.join(ROOT, "wbridge"))
        if (n.endswith(".py") and n != "__init__.py") or os.path.exists(os.path.join(ROOT, "wbridge", n, "__init__.py"))
    ]
    assert len(top) <= TOP_LEVEL_MAX, f"{len(top)} modules and packages under wbridge/: {sorted(top)}"


def test_no_reach_into_a_role_from_outside():
    owners = {"subscriber.py": ("sub", "subscriber", "self._sub"), "publisher.py": ("pub", "publisher", "self._pub")}
    hits = []
    for path in _modules().values():
        rel = os.path.relpath(path, ROOT)
        if not rel.startswith("wbridge" + os.sep):
            continue
        own = owners.get(os.path.basename(path)) if os.path.dirname(rel) == "wbridge" else None
        for n, line in enumerate(open(path), 1):
            for m in REACH_IN.finditer(line):
                if own is None or m.group(1) not in own:
                    hits.append(f"{rel}:{n}: {line.strip()}")
    assert not hits, "private attributes of a Subscriber or Publisher touched from outside:\n" + "\n".join(hits)


def test_pipeline_stages_never_import_the_roles():
    """``wbridge.pull`` and ``wbridge.publish`` get a context, not the Subscriber or Publisher."""
    graph = _graph()
    bad = [
        (m, d)
        for m, deps in graph.items()
        if m.startswith(("wbridge.pull", "wbridge.publish"))
        for d in deps
        if d in ("wbridge.subscriber", "wbridge.publisher", "wbridge")
    ]
    assert not bad, f"pipeline stages importing a role: {bad}"
