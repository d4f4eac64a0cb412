"""The build: the order of stages (``pipeline``), the parts each function becomes
(``builder``), the second writer for Core AI assets (``aimodel``), parts and the build cache,
and staging of outputs."""

__all__ = ["aimodel", "builder", "cache", "parts", "pipeline", "records", "staging"]
