"""The one error boundary of the command line, and its logging set-up: every AdapterpackError
becomes one line and its documented exit code; anything else is an internal error (exit 1)
with the traceback behind ``ADAPTERPACK_DEBUG=1``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sys
from collections.abc import Iterator

import typer

from adapterpack.cli.render import err, out, verify_table
from adapterpack.errors import AdapterpackError
from adapterpack.quiet import silence_libraries


def _debug() -> bool:
    return os.environ.get("ADAPTERPACK_DEBUG", "") not in ("", "0")


def configure_logging(quiet: bool) -> None:
    level = logging.DEBUG if _debug() else (logging.WARNING if quiet else logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("adapterpack")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    if not _debug():

        silence_libraries()


# Set by the SIGINT handler (see below); read by the boundary's catch-all.
_interrupted = False


def _on_sigint(signum, frame) -> None:
    # Remember the interrupt: libraries (torch.jit) may wrap the KeyboardInterrupt in their own
    # error type on its way out, and Ctrl-C must still exit 130.
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


# errno values that are the machine's limits (exit 4) or a path the user gave (exit 2).
_RESOURCE_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EMFILE, errno.ENFILE, errno.ENOMEM})
_INPUT_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ENOENT, errno.ELOOP, errno.EEXIST, errno.EINVAL})


def _first_copy_error(error: OSError) -> OSError:
    """shutil.copytree gathers every failed file into one error holding a list; report the first
    as one line (``copying SRC: reason``), not the list."""
    failures = error.args[0] if isinstance(error, shutil.Error) and error.args else None
    if isinstance(failures, list) and failures and isinstance(failures[0], tuple) and len(failures[0]) == 3:
        source, _, reason = failures[0]
        more = f" (and {len(failures) - 1} more file(s))" if len(failures) > 1 else ""
        return OSError(f"copying {source}: {reason}{more}")
    return error


@contextlib.contextmanager
def _ctrl_c_exits_130() -> Iterator[None]:
    """Ctrl-C handled by ``_on_sigint`` while a command runs; the previous handler back after it
    (a command run in a longer-lived process, the Python API's caller or a test runner, leaves
    Ctrl-C as it found it)."""
    import signal

    try:
        previous = signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:  # not the main thread (e.g. under a test runner's worker)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def error_boundary() -> Iterator[None]:
    """Turn every failure into one line on stderr and a documented exit code."""
    with _ctrl_c_exits_130():
        try:
            yield
        except AdapterpackError as error:
            if _debug():
                raise
            if getattr(error, "report", None) is not None:
                out.print(verify_table(error.report))
            err.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
            raise typer.Exit(error.exit_code) from None
        except KeyboardInterrupt:
            err.print("interrupted", highlight=False)
            raise typer.Exit(130) from None
        except typer.Exit:
            raise
        except MemoryError:
            err.print("[bold red]error:[/] out of memory", highlight=False)
            raise typer.Exit(4) from None
        except OSError as error:
            if _debug():
                raise
            error = _first_copy_error(error)
            code = getattr(error, "errno", None)
            if code == errno.ENOSPC or "[Errno 28]" in str(error):
                err.print(f"[bold red]error:[/] out of disk space: {error}", highlight=False, soft_wrap=True)
                raise typer.Exit(4) from None
            if code in _RESOURCE_ERRNOS or code in _INPUT_ERRNOS:
                # The system's or the user's condition (a read-only or full disk, a path too long or
                # not a folder), not a bug: the documented codes, with the path in the message.
                err.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
                raise typer.Exit(4 if code in _RESOURCE_ERRNOS else 2) from None
            err.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except Exception as error:  # noqa: BLE001 - the one place that catches everything
            if _interrupted:
                err.print("interrupted", highlight=False)
                raise typer.Exit(130) from None
            if _debug():
                raise
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            err.print(
                f"[bold red]internal error:[/] {type(error).__name__}: {first} "
                "(run with ADAPTERPACK_DEBUG=1 for the traceback)",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1) from None
