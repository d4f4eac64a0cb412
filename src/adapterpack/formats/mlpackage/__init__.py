"""The Core ML ``.mlpackage`` on disk, and the one place that knows its bytes: the weight-blob
format, the model spec, the functions it declares and their digests, the streaming
multifunction merge, patching weight records in place, and the format's description (``format``)."""

__all__ = ["blob", "digest", "format", "functions", "merge", "spec", "weight_patch"]
