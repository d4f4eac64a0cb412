"""Reports on a built package: each format's inspection (``inspectors``), what it needs in
memory on each device (``memory``), and the Swift names of its functions (``swift``)."""

__all__ = ["inspectors", "memory", "swift"]
