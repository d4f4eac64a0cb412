"""The ``.mlpackage`` on disk, and the one place that knows its bytes: the weight-blob format,
the model spec, the functions it declares and their digests, package metadata, the streaming multifunction merge,
and patching weight records in place."""

__all__ = ["aimodel", "blob", "digest", "functions", "merge", "metadata", "spec", "weight_patch"]
