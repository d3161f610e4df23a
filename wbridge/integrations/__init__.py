"""Engine and framework integrations (optional dependencies, imported on use)."""
