"""One source of truth for the extras: pyproject.toml's optional-dependencies. The README's extras
table lists exactly those, and scripts/setup.sh installs every one of them (``ray`` into the vLLM
venv, with the version pyproject pins)."""

from __future__ import annotations

import os
import re

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")

ROOT = os.path.join(os.path.dirname(__file__), "..")


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def extras() -> dict[str, list[str]]:
    return tomllib.loads(read("pyproject.toml"))["project"]["optional-dependencies"]


def test_readme_extras_table_lists_exactly_pyprojects_extras() -> None:
    readme = read("README.md")
    table = readme[readme.index("<!-- extras:") :].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `([a-z0-9_-]+)` \|", table, re.MULTILINE)
    assert len(listed) == len(set(listed)), listed
    assert sorted(listed) == sorted(extras()), (listed, sorted(extras()))


def test_setup_installs_every_extra() -> None:
    setup = read("scripts/setup.sh")
    main = re.findall(r'^\s*\.venv/bin/pip install -q -e "\.\[([a-z0-9_,-]+)\]"', setup, re.MULTILINE)
    assert len(main) == 1, main
    assert sorted(main[0].split(",")) == sorted(set(extras()) - {"ray"})
    (ray,) = extras()["ray"]
    assert re.search(rf"^\s*\.venv-vllm/bin/pip install -q {re.escape(ray)}$", setup, re.MULTILINE), ray


def test_demo_comment_states_the_demo_models_size() -> None:
    from wbridge.testing.demo import DemoConfig

    mib = round(DemoConfig().model.nbytes / 2**20)
    assert f"{mib} MiB" in read("scripts/demo.sh") and f"{mib} MiB" in read("README.md")
