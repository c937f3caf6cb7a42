"""Operational tools that are not part of the runtime: benchmarks and their helpers."""
