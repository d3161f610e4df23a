"""Imported by the suite's forkserver (``harness.py``), after torch and wbridge: loads the compiled
delta encoder there once (``protocol.delta.load_encoder``), so that each forked worker that
publishes deltas does not pay numba's start-up (about 0.3 s of CPU) itself."""

from wbridge.protocol.delta import load_encoder

load_encoder()
