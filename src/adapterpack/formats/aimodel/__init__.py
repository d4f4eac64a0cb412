"""The Core AI ``.aimodel``: reading an asset (``asset``) and the format's description (``format``)."""

__all__ = ["asset", "format"]
