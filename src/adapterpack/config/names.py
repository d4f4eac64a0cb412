"""The one rule for every name that becomes a file name or a Swift identifier.

A package name becomes ``NAME.mlpackage``, ``NAME.mlpackage.zip``, the release bundle's folder
``NAME/`` and a line of ``SHA256SUMS``; a function name becomes a part's files
(``NAME.mlpackage``, ``NAME.part.json``), an Apple bundle's folder, a Swift enum case and the
string an app passes as ``MLModelConfiguration.functionName``; a Swift type name becomes the
generated enum's. Each is checked here, once, wherever it comes from (the manifest, the command
line), so a name that validates is one every later step can write.
"""

from __future__ import annotations

import re

# Letters, digits and "_", not starting with a digit: a Swift identifier an app can type, and a
# file name on every file system.
SWIFT_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A package name as the Hugging Face hub spells a repository's (the release bundle is laid out
# as one and can be uploaded as it is): letters, digits, ".", "_", "-", starting with a letter
# or digit (never ".", ".." or a hidden file), no separators, spaces or control characters.
PACKAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# File names hold 255 bytes; a name gets a suffix and, while it is written, a staging prefix
# (``.NAME.release.adapterpack-staging-PID-XXXXXXXX``) of up to about 60 more.
MAX_NAME_LENGTH = 128

# Swift reserved words: an enum case of one needs backticks; a type cannot be one.
SWIFT_KEYWORDS = frozenset({
    "associatedtype", "class", "deinit", "enum", "extension", "fileprivate", "func", "import", "init",
    "inout", "internal", "let", "open", "operator", "private", "precedencegroup", "protocol", "public",
    "rethrows", "static", "struct", "subscript", "typealias", "var", "break", "case", "catch",
    "continue", "default", "defer", "do", "else", "fallthrough", "for", "guard", "if", "in", "repeat",
    "return", "throw", "switch", "where", "while", "Any", "as", "await", "false", "is", "nil", "self",
    "Self", "super", "throws", "true", "try", "_",
})


def _shown(value: str) -> str:
    """The name as a message shows it: quoted, control characters escaped, a long one cut."""
    text = repr(value) if len(value) <= 40 else repr(value[:40])[:-1] + "...'"
    return text


def _check_length(value: str, what: str) -> None:
    if len(value.encode("utf-8")) > MAX_NAME_LENGTH:
        raise ValueError(f"{what} {_shown(value)} is {len(value)} characters long: at most {MAX_NAME_LENGTH}")


def check_function_name(value: str) -> str:
    """A function name, or ValueError saying why it is not one (Swift string literal and file name)."""
    if not SWIFT_IDENTIFIER.fullmatch(value):
        raise ValueError(
            f"function name {_shown(value)} is not usable from Swift: use letters, digits and '_', not starting with a digit"
        )
    _check_length(value, "function name")
    return value


def check_package_name(value: str) -> str:
    """A package name, or ValueError saying why it is not one (file names of the package and release)."""
    if not PACKAGE_NAME.fullmatch(value):
        raise ValueError(
            f"name {_shown(value)} cannot name the package's files: use letters, digits, '.', '_' and '-', "
            "starting with a letter or digit (as a Hugging Face repository name)"
        )
    _check_length(value, "name")
    return value


def check_swift_type_name(value: str) -> str:
    """A Swift type name for the generated enum, or ValueError saying why it is not one."""
    if not SWIFT_IDENTIFIER.fullmatch(value) or value in SWIFT_KEYWORDS:
        raise ValueError(f"{_shown(value)} is not a Swift type name: use letters, digits and '_', not starting with a digit, not a keyword")
    _check_length(value, "Swift type name")
    return value


def swift_case_name(name: str) -> str:
    """The Swift enum case of a function name (backquoted when it is a keyword)."""
    return f"`{name}`" if name in SWIFT_KEYWORDS else name
