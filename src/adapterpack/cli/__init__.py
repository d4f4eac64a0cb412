"""The command line: commands that parse arguments and call the library (``app``), rendering
(``render``), and the one error boundary (``boundary``)."""

__all__ = ["app", "boundary", "render"]
