"""The Core ML ``.mlpackage``, and the one place that knows its bytes: the weight-blob format
(``blob``), the model spec (``spec``), the functions it declares and their digests
(``functions``, ``digest``), the streaming multifunction merge (``merge``), patching weight
records in place (``weight_patch``), the format's description (``format``); tracing and
converting the export decoder with coremltools (``conversion``), compression as coremltools
configs (``weights``) and palettes written into the program record by record (``program``), the
numpy executor verify runs a function on (``executor``), and where a package's bytes go
(``inspection``). Its part-wise writer is the build's own path (``assemble.builder``)."""

__all__ = [
    "blob", "conversion", "digest", "executor", "format", "functions", "inspection", "merge", "program", "spec",
    "weight_patch", "weights",
]
