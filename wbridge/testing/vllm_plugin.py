"""wbridge's vLLM plugin entry point, for runs from a source tree (tests, benchmarks).

vLLM loads its ``vllm.general_plugins`` entry points in every process it starts (its workers are
spawned on CPU); that is how the ``wbridge`` weight-transfer backend gets registered there. An
installed wbridge provides the entry point; a source checkout on ``PYTHONPATH`` does not, so this
writes a minimal distribution that declares it, taken from ``pyproject.toml`` (a wrong entry point
there then fails the run that uses it).
"""

from __future__ import annotations

import os

import tomllib


def plugin_dist(where: str | os.PathLike, pyproject: str | os.PathLike) -> str:
    """Writes under ``where`` a distribution declaring ``pyproject``'s ``vllm.general_plugins``
    entry points; returns ``where`` as a string, for ``PYTHONPATH``."""
    with open(pyproject, "rb") as f:
        plugins = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]
    info = os.path.join(where, "wbridge_vllm_plugin-0.0.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: wbridge-vllm-plugin\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in plugins.items()))
    return str(where)
