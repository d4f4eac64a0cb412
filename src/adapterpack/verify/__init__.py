"""Verification: every function of a package against its PyTorch/peft reference, driven the
way real clients call it, on our numpy executor of the ML Program (or Core ML on macOS)."""

__all__ = ["coreai_engine", "drives", "executor", "metrics", "package", "ranges", "reference", "reports", "runners"]
