"""Compression both formats share: palettes (our 1-D k-means, the build's palette store), error
compensation and the channel importance it weighs by, linear quantization; each format writes
them as its own ops (``formats.<name>.weights``)."""

__all__ = ["compensation", "importance", "kmeans", "palettes", "quantize"]
