"""The ``.mlpackage`` on disk, and the one place that knows its bytes: the weight-blob format,
the model spec, the functions it declares, package metadata, the streaming multifunction merge,
and patching weight records in place."""

__all__ = ["blob", "functions", "merge", "metadata", "spec", "weight_patch"]
