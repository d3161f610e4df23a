"""The worked example in docs/planner.md runs and prints exactly what the document shows."""
from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

pytestmark = pytest.mark.timeout(60)

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "planner.md")


def test_worked_example_output_matches_the_document():
    with open(DOC) as f:
        text = f.read()
    code = re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)
    shown = re.search(r"prints\n\n```\n(.*?)```", text, re.DOTALL).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/planner.md", "exec"), {})  # noqa: S102 (our own document's example)
    assert out.getvalue() == shown
