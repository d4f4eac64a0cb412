"""The build: the order of stages (``pipeline``), parts and the build cache, staging of outputs,
and reproducible releases."""

__all__ = ["builder", "cache", "parts", "pipeline", "records", "release", "staging"]
