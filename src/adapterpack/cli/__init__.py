"""The command line: commands that parse arguments and call the library (``app``), rendering
(``render``), and the one error boundary (``boundary``).

The thread pools are set up here, before ``app`` imports numpy (and later torch), which read
them when they load (``adapterpack.threads``)."""

from adapterpack.threads import use_machine_threads

use_machine_threads()

__all__ = ["app", "boundary", "flags", "render"]
