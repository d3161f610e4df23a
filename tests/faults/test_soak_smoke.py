"""``benchmarks/soak.py`` in small: 10 versions with kills (its ``main``, run in this process so its
workers come from the already warm forkserver); the last line has the documented format and shows
no torn, stale or hung pull; the same-epoch restart put checksum records of the lost history back
(and verifying readers refused them), and both watchers followed the store loss to the last version."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

from tests.hosts import ROOT

LAST_LINE = re.compile(r"^soak: versions=(\d+) pulls=(\d+) torn=(\d+) hangs=(\d+) stale=(\d+) restarts=(\d+)( .*)?$")


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", os.path.join(ROOT, "benchmarks", "soak.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_soak_smoke(capsys) -> None:
    status = load_soak().main(
        ["--versions", "10", "--kill-prob", "0.25", "--seed", "3", "--timeout", "30", "--lease-ttl", "1.0"]
        + [
            "--store-restarts",
            "1",
            "--replica-deaths",
            "1",
            "--slowloris",
            "16",
            "--frozen-relay",
            "1",
            "--freeze-s",
            "3",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    m = LAST_LINE.match(lines[-1])
    assert m, f"last line {lines[-1]!r} is not the soak line"
    versions, pulls, torn, hangs, stale, restarts = map(int, m.groups()[:6])
    assert (versions, torn, hangs, stale) == (10, 0, 0, 0), lines[-2:]
    assert pulls >= 5 and restarts >= 1, lines[-2:]  # subscribers may skip versions (and a lost store)
    assert "store lost 1x (1 with its generation record replayed), replicas killed 1x" in lines[-2], lines[-2]
    assert "relay frozen 1x" in lines[-2], lines[-2]
    assert "same-epoch restarts at epochs [2]" in lines[-2], lines[-2]  # (a replica death made epoch 2)
    assert "checksum records of a lost history put back for 2 versions" in lines[-2], lines[-2]
    assert "'IntegrityError'" in lines[-2], lines[-2]  # refused by verifying readers
    assert "watchers on the final version 2/2" in lines[-2] and m.group(7) == " watchers=2/2", lines[-2:]
    assert status == 0, lines
