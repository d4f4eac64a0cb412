"""The build: what it will do, decided once (``plan``), the order of stages (``pipeline``), the
Core ML writer's parts (``builder``, ``parts``), the Core AI writer (``aimodel``), the build
cache, and staging of outputs."""

__all__ = ["aimodel", "auto", "builder", "cache", "calibration", "disk", "parts", "pipeline", "plan", "records", "staging"]
