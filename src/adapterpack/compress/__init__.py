"""Compression of a converted function: palettization (with our 1-D k-means), linear
quantization, pruning, and float16 exceptions, per the manifest's rules."""

__all__ = ["compensation", "importance", "kmeans", "model", "palettes", "program", "quantize"]
