"""Reports on a built package: where its bytes go (``inspect``), what it needs in memory on each
device (``memory``), and the Swift names of its functions (``swift``)."""

__all__ = ["inspect", "inspectors", "memory", "swift"]
