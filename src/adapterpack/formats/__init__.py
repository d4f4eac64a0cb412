"""The output formats, one package each (``mlpackage``: Core ML, ``aimodel``: Core AI), what a
format is to the rest of adapterpack (``format``), the registry that maps names and paths to
them (``registry``), and what every format's reader gives (``listing``) and records
(``metadata``)."""

__all__ = ["aimodel", "format", "listing", "metadata", "mlpackage", "registry"]
