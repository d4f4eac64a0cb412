"""The Core AI ``.aimodel``, everything about it in one place: the format's description
(``format``), reading an asset (``asset``), converting functions into one program in one
converter session (``conversion``), compressed weights as Core AI ops (``weights``), the writer
(``writer``), running an asset as its clients do (``runtime``, with Apple's Swift engine
emulated in ``engine``), what ``inspect`` reports of it (``inspection``) and the bundles Apple's
Swift runtime loads (``bundle``). docs/adding-a-format.md says who asks for each, and
pyproject.toml's import contracts which layer each sits in."""

__all__ = ["asset", "bundle", "conversion", "engine", "format", "inspection", "runtime", "weights", "writer"]
