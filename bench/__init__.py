"""Benchmarks: chatcore against its baselines, measured in the same run."""
