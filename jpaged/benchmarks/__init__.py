"""Benchmarks of a running server, and the arithmetic of sizing one (no engine import: a client)."""
