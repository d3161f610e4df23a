"""Every pair of option values works, or is refused before the first version (issue 34).

Six factors, and every pair of their values in at least one combination (all pairs, not the
full product of 1350: ``all_pairs``, a greedy covering): every pair that can work in a combination
that works, and every pair that cannot in a combination refused for that pair alone:

- staging: ``Staging()``, ``Staging(checksums=False)``, ``Staging(delta=Delta())``, ``ZeroCopy()``,
  ``ZeroCopy(checksums=False)``;
- mode: ``"sync"``, ``"one_step_off"``, ``Async(max_staleness=1)``;
- cast: none (fp32), ``register(dtype=torch.bfloat16)`` from fp32, ``transforms`` ``fp8_block128``;
- reader: plain, ``staged=True``, ``verify=True``, a zone reader ``Zone(z)`` (after its relay
  ``Zone(z, relay=True)``, of the whole layout, pulled each version), a relay itself;
- reader layout: every canonical tensor whole, a row slice, a column slice (across the two
  publisher ranks' shards, and across fp8 blocks);
- transport: ``tcp``, ``local``.

Each combination is its own channel: two publisher ranks (in one process) and its readers (in
another), three versions. Per combination, either every pull of every reader is bit-exact against
a reference computed by plain slicing of the publishers' fp32 masters with the cast applied (for
FP8 the quantised values the format defines, ``matrix_actors.expected``), and a zone reader read
bytes from its relay in every version; or the combination raises ``UsageError`` at construction,
``register`` or the first pull, where ``refusal`` says it must (and nowhere else), and the
publishers of a refused reader are not held up by it (it left the channel).

The combinations run (``python -m tests.runtime.test_option_matrix`` prints this table; a test
checks it matches):

<!-- matrix -->
| # | staging | mode | cast | reader | layout | transport | outcome |
|---|---|---|---|---|---|---|---|
| 1 | Staging() | sync | none | plain | whole | tcp | exact |
| 2 | Staging() | one_step_off | bf16 | staged | rows | local | exact |
| 3 | Staging(checksums=False) | Async(max_staleness=1) | fp8 | plain | cols | local | exact |
| 4 | Staging(delta=Delta()) | sync | bf16 | verify | cols | tcp | exact |
| 5 | ZeroCopy() | Async(max_staleness=1) | none | zone | rows | tcp | exact |
| 6 | Staging(delta=Delta()) | one_step_off | none | relay | whole | local | exact |
| 7 | Staging(checksums=False) | sync | fp8 | staged | whole | tcp | exact |
| 8 | ZeroCopy(checksums=False) | one_step_off | none | staged | cols | tcp | exact |
| 9 | Staging(delta=Delta()) | sync | fp8 | zone | rows | local | exact |
| 10 | Staging() | Async(max_staleness=1) | bf16 | verify | whole | local | exact |
| 11 | Staging() | sync | fp8 | relay | cols | tcp | exact |
| 12 | Staging(checksums=False) | one_step_off | bf16 | plain | rows | tcp | exact |
| 13 | ZeroCopy() | one_step_off | none | verify | whole | local | exact |
| 14 | Staging() | one_step_off | bf16 | zone | whole | tcp | exact |
| 15 | Staging(delta=Delta()) | Async(max_staleness=1) | bf16 | relay | rows | tcp | exact |
| 16 | ZeroCopy(checksums=False) | sync | none | plain | whole | local | exact |
| 17 | Staging() | one_step_off | fp8 | verify | rows | tcp | exact |
| 18 | ZeroCopy() | sync | none | plain | cols | tcp | exact |
| 19 | ZeroCopy(checksums=False) | Async(max_staleness=1) | none | staged | rows | tcp | exact |
| 20 | Staging() | sync | none | zone | cols | tcp | exact |
| 21 | Staging(checksums=False) | sync | none | plain | whole | tcp | exact |
| 22 | Staging(delta=Delta()) | sync | none | plain | whole | tcp | exact |
| 23 | Staging(delta=Delta()) | sync | none | staged | whole | tcp | exact |
| 24 | ZeroCopy() | sync | none | staged | whole | tcp | exact |
| 25 | ZeroCopy() | sync | none | relay | whole | tcp | exact |
| 26 | Staging(checksums=False) | sync | none | verify | whole | tcp | refused at pull (2) |
| 27 | Staging(checksums=False) | one_step_off | bf16 | zone | rows | local | refused at pull (3) |
| 28 | ZeroCopy() | sync | fp8 | plain | cols | local | refused at register (1) |
| 29 | ZeroCopy(checksums=False) | Async(max_staleness=1) | bf16 | staged | cols | tcp | refused at register (1) |
| 30 | ZeroCopy(checksums=False) | one_step_off | none | relay | whole | local | refused at pull (3) |
| 31 | Staging(checksums=False) | Async(max_staleness=1) | fp8 | relay | rows | tcp | refused at pull (3) |
| 32 | ZeroCopy() | one_step_off | bf16 | plain | whole | tcp | refused at register (1) |
| 33 | ZeroCopy(checksums=False) | sync | none | zone | rows | tcp | refused at pull (3) |
| 34 | ZeroCopy(checksums=False) | one_step_off | fp8 | staged | whole | local | refused at register (1) |
| 35 | ZeroCopy(checksums=False) | Async(max_staleness=1) | none | verify | cols | local | refused at pull (2) |
<!-- /matrix -->

Why each refusal (``REASONS``):

1. ``ZeroCopy`` serves the live tensors as they are, so ``register(dtype=)`` and
   ``register(transforms=)`` (which need a staging copy to cast into) raise ``UsageError`` at
   ``register``.
2. With ``checksums=False`` the publishers keep nothing to check bytes against: a ``verify=True``
   reader raises ``UsageError`` at its first pull.
3. Likewise a zone's readers and relays (relays are peers, not authorities: their bytes are
   checked against the publishers' checksums).

``Staging(delta=Delta(), checksums=False)`` (deltas are verified against the checksums) is refused
when the value is built (``test_refused_values``), so it is no staging value of the matrix.
"""

from __future__ import annotations

import itertools
import re
import time

import pytest

from wbridge import Async, Delta, Staging, UsageError, ZeroCopy, open_store

from .harness import Worker, free_port
from .matrix_actors import MatrixPubs, MatrixSubs

STAGING = {
    "Staging()": Staging(),
    "Staging(checksums=False)": Staging(checksums=False),
    "Staging(delta=Delta())": Staging(delta=Delta()),
    "ZeroCopy()": ZeroCopy(),
    "ZeroCopy(checksums=False)": ZeroCopy(checksums=False),
}
MODES = {"sync": "sync", "one_step_off": "one_step_off", "Async(max_staleness=1)": Async(max_staleness=1)}
FACTORS = {
    "staging": list(STAGING),
    "mode": list(MODES),
    "cast": ["none", "bf16", "fp8"],
    "reader": ["plain", "staged", "verify", "zone", "relay"],
    "layout": ["whole", "rows", "cols"],
    "transport": ["tcp", "local"],
}
VERSIONS = 3


#: Why a combination is refused, by the number the table gives it.
REASONS = {
    1: "ZeroCopy cannot cast or transform",
    2: "verify=True needs the publishers' checksums",
    3: "zone relays need the publishers' checksums",
}


def refusal(row: dict[str, str]) -> tuple[str, int] | None:
    """Where a combination must raise ``UsageError`` (``"register"`` or ``"pull"``) and why (a key
    of ``REASONS``), or None where it must work."""
    zero_copy = row["staging"].startswith("ZeroCopy")
    if zero_copy and row["cast"] != "none":
        return "register", 1
    if "checksums=False" in row["staging"]:
        if row["reader"] == "verify":
            return "pull", 2
        if row["reader"] in ("zone", "relay"):
            return "pull", 3
    return None


def _pairs(row: dict[str, str]) -> set:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(row, 2)}


def all_pairs(factors: dict[str, list[str]]) -> list[dict[str, str]]:
    """Rows (one value per factor) that together hold every pair of values of every two factors:
    each pair that can work in a row that works (``refusal`` None), greedily (each row the first
    of the full product that holds the most pairs not held yet); then each pair that cannot
    (ZeroCopy with a cast, checksums=False with verify or a zone) in a row refused for that pair
    alone, spread over the other factors' values."""
    product = [dict(zip(factors, values)) for values in itertools.product(*factors.values())]
    works = [row for row in product if refusal(row) is None]
    good = set().union(*map(_pairs, works))
    rows: list[dict[str, str]] = []
    todo = set(good)
    while todo:
        best = max(works, key=lambda row: len(_pairs(row) & todo))
        rows.append(best)
        todo -= _pairs(best)
    bad = set().union(*map(_pairs, product)) - good
    alone = [row for row in product if len(_pairs(row) & bad) == 1]
    held: set = set()  # pairs of the refused rows so far
    while bad:
        best = max(alone, key=lambda row: (len(_pairs(row) & bad), len(_pairs(row) - held)))
        rows.append(best)
        bad -= _pairs(best)
        held |= _pairs(best)
    return rows


ROWS = all_pairs(FACTORS)


def table() -> str:
    """The module docstring's table of ``ROWS``."""
    cols = list(FACTORS)
    lines = ["| # | " + " | ".join(cols) + " | outcome |", "|---" * (len(cols) + 2) + "|"]
    for k, row in enumerate(ROWS, 1):
        why = refusal(row)
        outcome = "exact" if why is None else f"refused at {why[0]} ({why[1]})"
        lines.append(f"| {k} | " + " | ".join(row[c] for c in cols) + f" | {outcome} |")
    return "\n".join(lines)


def test_all_pairs_covered_and_documented() -> None:
    """Every pair of values that can work is in a row that works, every other pair in a row refused
    for it alone; far fewer rows than the product; the docstring's table is the one the test runs."""
    product = [dict(zip(FACTORS, values)) for values in itertools.product(*FACTORS.values())]
    good = set().union(*(_pairs(r) for r in product if refusal(r) is None))
    every = set().union(*map(_pairs, product))
    assert good <= set().union(*(_pairs(r) for r in ROWS if refusal(r) is None))
    for pair in every - good:
        assert any(_pairs(r) & (every - good) == {pair} for r in ROWS), pair
    assert len(every) == 180 and len(every - good) == 10 and len(ROWS) == 35 < len(product) // 30
    documented = re.search(r"<!-- matrix -->\n(.*)\n<!-- /matrix -->", __doc__, re.S).group(1)
    assert documented == table(), "the docstring's table drifted: python -m tests.runtime.test_option_matrix"


def test_refused_values() -> None:
    """Option values that cannot work are refused when they are built."""
    with pytest.raises(UsageError, match="checksums"):
        Staging(delta=Delta(), checksums=False)


def _run_row(pubs: Worker, subs: Worker, k: int, row: dict[str, str]) -> list[str]:
    """Runs combination ``k``; the failures found, as text."""
    ch = f"m{k}"
    why = refusal(row)
    where = f"#{k} {row}"
    got = pubs.call("open", ch, row["transport"], STAGING[row["staging"]], MODES[row["mode"]], row["cast"])
    if got is not None or (why is not None and why[0] == "register"):
        if why is None or why[0] != "register":
            return [f"{where}: publishers refused unexpectedly: {got}"]
        if not (got or "").startswith("register: UsageError"):
            return [f"{where}: publishers not refused at register ({REASONS[why[1]]}): {got}"]
        return []
    try:
        got = subs.call("open", ch, row["transport"], row["reader"], row["layout"], row["cast"])
        if got is not None:
            return [f"{where}: readers refused at {got}"]
        for v in range(1, VERSIONS + 1):
            t0 = time.monotonic()
            pubs.send("publish", ch, v)
            subs.send("pull", ch, v)
            pulled, published = subs.result(90), pubs.result(90)
            if published != [v, v]:
                return [f"{where}: publishers returned {published} for version {v} ({time.monotonic() - t0:.1f}s)"]
            errors = [r for r in pulled if "error" in r]
            if why is not None:
                if v == 1 and errors and len(errors) == len(pulled) and all(r["error"] == "UsageError" for r in errors):
                    return []  # refused at the first pull; the publishers went on without it
                return [f"{where}: not refused at the first pull ({REASONS[why[1]]}): {pulled}"]
            for r in pulled:
                if "error" in r:
                    return [f"{where}: v{v} {r['role']} raised {r['error']}: {r['message']}"]
                if r["v"] != v or r["bad"]:
                    return [f"{where}: v{v} {r['role']} pulled v{r['v']}, differing in {r['bad']}"]
            if row["reader"] == "zone" and pulled[-1]["from_peers"] == 0:
                return [f"{where}: v{v} the zone reader read nothing from its relay: {pulled}"]
        return []
    finally:
        subs.call("close", ch)
        pubs.call("close", ch)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", FACTORS["transport"])
def test_option_matrix(transport: str) -> None:
    """The combinations of ``transport``, one after the other on one store and two processes."""
    rows = [(k, row) for k, row in enumerate(ROWS, 1) if row["transport"] == transport]
    store = open_store(f"tcp://127.0.0.1:{free_port()}", host_store=True)
    pubs = subs = None
    try:
        pubs = Worker("pubs", MatrixPubs, store.url)
        subs = Worker("subs", MatrixSubs, store.url)
        failures: list[str] = []
        for k, row in rows:
            failures += _run_row(pubs, subs, k, row)
        assert not failures, "\n".join(failures)
    finally:
        for w in (subs, pubs):
            if w is not None:
                w.stop()
        store.close()


if __name__ == "__main__":
    print(table())
