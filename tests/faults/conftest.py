"""Fault tests: real processes, so fault_workers/fault_helpers must be importable by name."""
