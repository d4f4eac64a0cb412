"""The command-line flags of ``BuildOptions``, generated from its fields: each field declares its
flag, help and default once (``assemble.records``), and a command lists the fields it takes.

    @app.command()
    @options_flags("force", "strict", "backend")
    def merge(parts_dir: ..., options: BuildOptions) -> None: ...

The command's signature, as typer reads it, gets one option per named field in place of
``options``; the function is called with the ``BuildOptions`` they make.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer

from adapterpack.assemble.records import BuildOptions
from adapterpack.cli.boundary import error_boundary

_FIELDS = {f.name: f for f in dataclasses.fields(BuildOptions)}
_HINTS = typing.get_type_hints(BuildOptions)


def options_flags(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Replace the command's ``options: BuildOptions`` parameter by the flags of fields ``names``
    (the rest keep their defaults)."""
    unknown = sorted(set(names) - set(_FIELDS))
    if unknown:
        raise ValueError(f"BuildOptions has no field {unknown}")

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "options"]
        flags = [_parameter(name) for name in names]
        # typer reads the options in signature order; a command's own trailing flags (--quiet) stay last
        parameters = own[:-1] + flags + own[-1:] if own and own[-1].name == "quiet" else own + flags

        @functools.wraps(command)
        def run(**given: Any) -> Any:
            values = {name: given.pop(name) for name in names}
            values = {name: (not value if _FIELDS[name].metadata["negates"] else value) for name, value in values.items()}
            return command(**given, options=_made(values))

        run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": signature.return_annotation}
        return run

    return decorate


def option_of(name: str) -> Any:
    """The annotated type of field ``name``'s flag, for a command that takes the value alone
    (``verify --backend``): ``Annotated[str, typer.Option("--backend", help=...)]``."""
    field = _FIELDS[name]
    kind = bool if field.metadata["negates"] else _HINTS[name]
    return Annotated[kind, typer.Option(field.metadata["flag"], help=field.metadata["help"])]


def _parameter(name: str) -> inspect.Parameter:
    default = False if _FIELDS[name].metadata["negates"] else _FIELDS[name].default
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=option_of(name))


def _made(values: dict[str, Any]) -> BuildOptions:
    """The options; a bad value (``--format onnx``) is refused as a command's own errors are:
    one line and exit 2."""
    with error_boundary():
        return BuildOptions(**values)
