"""The build: what it will do, decided once (``plan``), the order of stages (``pipeline``), the
Core ML writer's parts (``builder``, ``parts``), the build cache, and staging of outputs (a
format written whole brings its own writer: ``formats.aimodel.writer``)."""

__all__ = ["auto", "builder", "cache", "calibration", "disk", "parts", "pipeline", "plan", "records", "staging"]
