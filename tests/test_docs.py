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
