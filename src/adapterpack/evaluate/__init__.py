"""Running a built package on text: generating a continuation the way the Swift client drives a
function, and measuring a package's perplexity against its PyTorch reference on a user's text."""

__all__ = ["generate", "perplexity", "text"]
