"""The check the example and demo tests run on their logs catches each kind of noise, verbatim as
torch and multiprocessing print it, and lets ordinary warnings through."""

from __future__ import annotations

from tests.logs import noise

NOISY = [
    "[rank0]:[W1204 16:38:33.696761675 socket.cpp:469] [c10d] waitForInput: poll for socket SocketImpl(fd=78, "
    "addr=[::ffff:127.0.0.1]:53430, remote=[::ffff:127.0.0.1]:35941) returned 0, likely a timeout",
    "[W1204 16:34:47.919026184 socket.cpp:494] [c10d] waitForInput: socket SocketImpl(fd=19) timed out after 999ms",
    "[rank0]:[W1204 16:36:55.875895325 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=69): "
    "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?",
    "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to "
    "be 3 leaked semaphore objects to clean up at shutdown",
    "/usr/lib/python3.11/multiprocessing/resource_tracker.py:123: UserWarning: resource_tracker: process died "
    "unexpectedly, relaunching.  Some resources might leak.",
    "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to "
    "be 1 leaked shared_memory objects to clean up at shutdown",
]
QUIET = [
    "(SpawnProcess-3 pid=12557) WARNING 12-04 16:36:38 [cpu.py:224] Triton is not installed.",
    "[W1204 16:36:39.890082854 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation",
    "demo: OK, every pull bit-exact",
]


def test_noise_finds_each_kind_and_nothing_else() -> None:
    assert noise("\n".join(NOISY + QUIET)) == NOISY
