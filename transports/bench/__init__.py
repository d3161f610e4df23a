"""Transport throughput tests, as perftest runs them: ``wbridge bench transport``.

- ``server``: ``--serve``, a region of known bytes on the chosen transports behind an authenticated
  control port (``control``);
- ``client``: ``--connect HOST:PORT``, reading it at each op size (``reads``: streams, depth,
  duration or repeats, the figures), and through the raw engines underneath (``raw``);
- ``loopback``: this host alone (a server in a child process on loopback), and ``run_bench`` for the
  benchmarks;
- ``memory``, ``units``, ``report``: buffers and their pattern, sizes, the table and the chart;
- ``cli``: the command line.
"""

from __future__ import annotations

from .cli import main
from .loopback import memcpy_ceiling, run_bench
from .units import parse_size

__all__ = ["main", "memcpy_ceiling", "parse_size", "run_bench"]
