"""Verification reports: per function (metrics, thresholds, failures, the drive reported) and
per package, with the format version that keys cached verdicts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class FunctionReport:
    name: str
    compression: str
    cosine: float
    max_abs_error: float
    top1: float
    kl: float
    retention: float | None  # quality: the adapter's effect kept on real text (None for the base function)
    adapter_effect: float | None  # relative size of the adapter's effect on the logits
    thresholds: dict[str, float]
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    drive: str = ""  # the calling convention whose figures are reported (the worse one)
    by_drive: dict[str, dict[str, float]] = field(default_factory=dict)  # every drive's metrics
    digest: str = ""  # of the bytes verified (mlpackage.digest.function_digest)
    reused: bool = False  # these bytes equal bytes a build verified before: not run again
    # what the exact figures (cosine, max_abs_error, top1, kl) compare with: "own weights" (the
    # reference holding the package's weights) or "float32" (the format's weights cannot be read)
    reference: str = "own weights"
    # the quality verdict on real text: perplexity_ratio, agreement, kl, tokens (None: no real text)
    quality: dict[str, float] | None = None
    text: str = ""  # the real text the function ran on

    @property
    def passed(self) -> bool:
        return not self.failures

    def provenance(self) -> str:
        """Whether these figures were measured now or belong to equal bytes verified before."""
        digest = self.digest[:12] or "?"
        return f"bytes {digest} equal bytes verified before" if self.reused else f"verified now, bytes {digest}"


@dataclass
class VerifyReport:
    package: Path
    backend: str
    functions: list[FunctionReport]
    integrity: list[str] = field(default_factory=list)  # problems found without running anything

    @property
    def passed(self) -> bool:
        return not self.integrity and all(f.passed for f in self.functions)

    def verdict(self) -> str:
        failed = [f.name for f in self.functions if not f.passed]
        if self.passed:
            return f"verify: PASS: {len(self.functions)} function(s) match their PyTorch reference ({self.backend} backend)"
        reasons = list(self.integrity) + [f"{f.name}: {'; '.join(f.failures)}" for f in self.functions if not f.passed]
        return f"verify: FAIL: {', '.join(failed) or 'package'}: " + " | ".join(reasons)

    def as_json(self) -> dict:
        return {
            "package": str(self.package),
            "backend": self.backend,
            "passed": self.passed,
            "integrity": self.integrity,
            "functions": [
                {k: v for k, v in vars(f).items()} | {"passed": f.passed} for f in self.functions
            ],
        }


# Bump when what verification computes changes, so verdicts cached by an older version are not reused.
VERIFY_FORMAT = 5


def function_report_from_json(data: dict) -> FunctionReport:
    """A stored verdict, marked as reused."""
    known = set(FunctionReport.__dataclass_fields__)
    report = FunctionReport(**{k: v for k, v in data.items() if k in known})
    report.reused = True
    return report
