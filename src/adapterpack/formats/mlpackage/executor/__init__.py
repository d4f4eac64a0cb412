"""numpy executor of Core ML ML Programs: the interpreter, and its ops grouped by family."""

from adapterpack.formats.mlpackage.executor.interpreter import SUPPORTED_OPS, NonFinite, ProgramExecutor
from adapterpack.formats.mlpackage.executor.registry import DeclaredTypeMismatch, UnsupportedOp

__all__ = ["SUPPORTED_OPS", "DeclaredTypeMismatch", "NonFinite", "ProgramExecutor", "UnsupportedOp"]
