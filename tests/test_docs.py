"""The documentation's Python runs, and the API reference covers the public API.

Every ```python block in README.md and docs/*.md is executed, each in a fresh namespace, unless its
first line is a ``# not run: <why>`` comment (it needs a cluster, a GPU, an engine or names from
around it). A block followed by a paragraph ``prints`` and a plain ``` block must print exactly
that. docs/development.md states this convention for authors.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import shutil
import subprocess
import sys
from html import unescape

import pytest

import wbridge

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.join(os.path.dirname(__file__), "..")
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
BLOCK = re.compile(r"^```python\n(.*?)^```\n(?:\nprints\n\n```\n(.*?)^```\n)?", re.DOTALL | re.MULTILINE)
SKIP = re.compile(r"# not run: \S")


def blocks() -> list:
    found = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        for m in BLOCK.finditer(text):
            line = text[: m.start()].count("\n") + 1
            code, shown = m.group(1), m.group(2)
            if SKIP.match(code.splitlines()[0] if code else ""):
                continue
            found.append(pytest.param(doc, line, code, shown, id=f"{doc}:{line}"))
    return found


@pytest.mark.parametrize(("doc", "line", "code", "shown"), blocks())
def test_runnable_python_block_runs_and_prints_what_the_document_shows(doc, line, code, shown) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile("\n" * line + code, doc, "exec"), {"__name__": "__docs__"})  # noqa: S102 (our own documents)
    if shown is not None:
        assert out.getvalue() == shown, f"{doc}:{line}: the block prints something other than the document shows"


def test_every_block_is_runnable_or_says_why_not() -> None:
    """A ```python block that does not run must say so (and why) on its first line."""
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        for m in BLOCK.finditer(text):
            first = m.group(1).splitlines()[0] if m.group(1) else ""
            if first.startswith("# not run"):
                assert SKIP.match(first), f"{doc}: '# not run' needs a reason: {first!r}"


def test_the_examples_that_run_include_the_readme_and_planner_ones() -> None:
    ran = {p.values[0] for p in blocks()}
    assert {"README.md", "docs/planner.md"} <= ran, ran


def test_api_reference_page_names_every_public_name() -> None:
    with open(os.path.join(ROOT, "docs", "reference.md")) as f:
        page = f.read()
    missing = [n for n in wbridge.__all__ if f"::: wbridge.{n}\n" not in page]
    assert not missing, f"docs/reference.md lacks {missing}"


@pytest.mark.slow
def test_built_site_shows_every_public_name_with_its_docstring(tmp_path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed (pip install -e '.[docs]')")
    exe = shutil.which("mkdocs", path=os.path.dirname(sys.executable))
    assert exe is not None
    site = tmp_path / "site"
    run = subprocess.run(
        [exe, "build", "--strict", "--site-dir", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=110
    )
    assert run.returncode == 0, run.stderr[-3000:]
    html = (site / "reference" / "index.html").read_text()
    text = re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", "", html)))
    for name in wbridge.__all__:
        obj = getattr(wbridge, name)
        assert f'id="wbridge.{name}"' in html, f"{name} has no entry in the built API reference"
        doc = (obj.__doc__ or "").strip()
        if doc:
            first = re.sub(r"``?", "", doc.splitlines()[0]).strip()
            words = " ".join(first.split()[:6])
            assert words in text, f"{name}: its docstring is not on the page ({words!r})"


def test_transport_options_table_names_each_constructors_options() -> None:
    """docs/transports.md lists, per transport, exactly the options its constructor takes (the
    schema ``Transport.check_options`` checks against), so the page cannot drift from the code."""
    import transports
    from transports.base import option_schema

    with open(os.path.join(ROOT, "docs", "transports.md")) as f:
        text = f.read()
    rows = dict(re.findall(r"^\| `(\w+)` \| (`.*) \|$", text.split("## Options", 1)[1].split("\n## ", 1)[0], re.M))
    assert set(rows) == set(transports.REGISTRY), rows
    for name in transports.available():
        listed = {item.strip().strip("`") for item in re.sub(r"\([^)]*\)", "", rows[name]).split(",")}
        assert listed == set(option_schema(transports.get(name).__init__)), (name, listed)


NAMED = re.compile(r"`{1,2}((?:wbridge|planner|transports)(?:\.[A-Za-z_]\w*)+)")


def _module_file(parts: list[str]) -> str | None:
    base = os.path.join(ROOT, *parts)
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(path):
            return path
    return None


def _defines(path: str, names: list[str]) -> bool:
    """Whether the module at ``path`` defines ``names[0]`` (a def, a class, an assignment, or an
    import from a module of the tree, followed there), and the rest as names inside it."""
    import ast

    pkg = os.path.relpath(os.path.dirname(path), ROOT).split(os.sep)
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == names[0]:
            inner = {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            return all(a in inner for a in names[1:])
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == names[0] for t in targets):
            return len(names) == 1
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == names[0] for a in node.names):
            source = (pkg[: len(pkg) - node.level + 1] if node.level else []) + (node.module or "").split(".")
            found = _module_file([p for p in source if p])
            return found is not None and _defines(found, names)
    return False


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module or package of the tree, or a name one of them defines (read
    from the source, so a module whose engine is not installed here still counts)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = _module_file(parts[:i])
        if path is not None:
            return i == len(parts) or _defines(path, parts[i:])
    return False


def test_every_module_a_doc_or_docstring_names_exists() -> None:
    """Docs, docstrings and comments name modules by dotted path (``wbridge.pull.session``), never by a
    name they used to have: each names a module of the tree, or a name such a module defines."""
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.md"], cwd=ROOT, capture_output=True, text=True).stdout
    missing = set()
    for rel in tracked.split():
        with open(os.path.join(ROOT, rel)) as f:
            for m in NAMED.finditer(f.read()):
                if not _resolves(m.group(1)):
                    missing.add(f"{rel}: {m.group(1)}")
    assert tracked
    assert not missing, sorted(missing)
