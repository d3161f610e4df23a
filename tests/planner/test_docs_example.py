"""The README's worked planner example runs and prints exactly what the README shows."""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

pytestmark = pytest.mark.timeout(60)

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_worked_example_output_matches_the_document():
    with open(DOC) as f:
        text = f.read()
    text = text[text.index("### Worked example: a TP=2 trainer to a fused TP=1 rollout") :]
    code = re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)
    shown = re.search(r"prints\n\n```\n(.*?)```", text, re.DOTALL).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})  # noqa: S102 (our own document's example)
    assert out.getvalue() == shown
