"""Releases: the verified package as a reproducible zip with its provenance and sums, and an
app-ready bundle (the package, the tokenizer files, a Swift enum of the functions and a model
card), laid out like a Hugging Face model repository; for Apple's runtime contract, one bundle
folder per function as Apple's Core AI Swift runtime loads it (``formats.aimodel.bundle``)."""

__all__ = ["artifacts", "bundle"]
