"""What the demo, the tests and the benchmarks share: fault injection and synthetic models."""
