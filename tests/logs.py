"""What a user must not find in the logs of the examples and the demo: torch's c10d socket warnings
from store waits (``[c10d] waitForInput ... timed out``, ``recvValueWithTimeout failed``) and
multiprocessing's resource-tracker reports (leaked semaphores or shared memory, a tracker that died)."""

from __future__ import annotations

import re

NOISE = re.compile(
    r"\[c10d\] (?:waitForInput|recvValueWithTimeout)"
    r"|resource_tracker: (?:There appear to be \d+ leaked|process died unexpectedly)"
    r"|leaked (?:semaphore|shared_memory) objects"
)


def noise(log: str) -> list[str]:
    """The lines of ``log`` that a quiet run does not print."""
    return [line for line in log.splitlines() if NOISE.search(line)]
