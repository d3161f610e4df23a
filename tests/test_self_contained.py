"""A clone is all a user has: no tracked file names a path outside the repository, neither an
absolute path of the machines it was written on (their home and work folders) nor the sibling
``shared`` folder those machines keep beside the checkout. Code reads its data relative to itself
(``benchmarks/model-shapes.json``), and docs and scripts point into the repository."""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# an absolute path under these machines' own folders (not a URL's path: nothing word-like before
# the slash), or the folder beside the checkout
OUTSIDE = re.compile(rb"(?<![\w.~-])/(?:work|root|home)/|\.\.[/\\]shared\b|/opt/(?:wheels|pypi)")
SKIP_DIRS = {".git", "__pycache__", "site", "build", ".pytest_cache", ".hypothesis"}


def tracked_files() -> list[str]:
    """The files git tracks; in an export without git, every file but venvs and build output."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
        return [p for p in out.stdout.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(ROOT):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith(".venv") and "egg-info" not in x]
            files += [os.path.relpath(os.path.join(d, n), ROOT) for n in names]
        return files


def outside_paths(root: str, files: list[str]) -> list[str]:
    """``path:line: text`` for every line of ``files`` (under ``root``) that names a path outside the
    repository."""
    found = []
    for rel in files:
        path = os.path.join(root, rel)
        if not os.path.isfile(path):  # deleted in the working tree, not yet in the index
            continue
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" in data[:8192]:  # binary (plots)
            continue
        for no, line in enumerate(data.splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{rel}:{no}: {line.decode(errors='replace').strip()[:160]}")
    return found


def test_no_tracked_file_names_a_path_outside_the_repository() -> None:
    files = tracked_files()
    assert len(files) > 100, files  # the listing worked
    found = outside_paths(ROOT, files)
    assert not found, "paths outside the repository:\n" + "\n".join(found)


def test_the_check_sees_each_kind_of_outside_path(tmp_path) -> None:
    """The pattern catches what it is for, and not URLs or paths inside the repository."""
    bad = ["SHAPES = '/" + "work/shared/x.json'", "see `.." + "/shared/notes.md`", "cd /" + "root/wbridge"]
    good = ["https://huggingface.co/" + "work/x", "docs/home/page.md", "PYTHONPATH=. .venv/bin/python", "/tmp/x"]
    (tmp_path / "f.txt").write_text("\n".join(bad + good) + "\n")
    assert [line.split(": ", 1)[1] for line in outside_paths(str(tmp_path), ["f.txt"])] == bad
