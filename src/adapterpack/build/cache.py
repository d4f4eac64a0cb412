"""The build cache: parts, converted bases (templates), palettes and verdicts on disk, keyed by
content, written atomically and pruned with the manifest's latest build.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from adapterpack.build.parts import PART_SUFFIX, PartRecord, place
from adapterpack.verify.reports import function_report_from_json

log = logging.getLogger(__name__)


TEMPLATES = "templates"


VERIFIED = "verified"


def _store(folder: Path, key: str, package: Path) -> Path:
    """Put ``package`` at ``folder/KEY.mlpackage`` by an atomic rename (its record file, written
    after, is what marks the entry complete); returns that path."""
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / f".{key}.incoming"
    shutil.rmtree(temporary, ignore_errors=True)
    place(package, temporary)
    target = folder / f"{key}.mlpackage"
    shutil.rmtree(target, ignore_errors=True)
    os.replace(temporary, target)
    return target


class PartCache:
    """Parts on disk by content key (default: ``.adapterpack-cache`` beside the output)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def get(self, key: str) -> Path | None:
        package = self.folder / f"{key}.mlpackage"
        if package.is_dir() and (self.folder / f"{key}{PART_SUFFIX}").is_file():
            return package
        return None

    def put(self, key: str, package: Path, record: PartRecord) -> None:
        _store(self.folder, key, package)
        (self.folder / f"{key}{PART_SUFFIX}").write_text(json.dumps(record.as_json(), indent=2, sort_keys=True))

    def template(self, key: str) -> Path | None:
        """A converted (and possibly compressed) base, by key; see ``builder._PartBuilder``."""
        package = self.folder / TEMPLATES / f"{key}.mlpackage"
        return package if package.is_dir() and package.with_suffix(".json").is_file() else None

    def put_template(self, key: str, package: Path, base_sha256: str) -> None:
        target = _store(self.folder / TEMPLATES, key, package)
        target.with_suffix(".json").write_text(json.dumps({"base": base_sha256}))

    def verified(self, keys: dict[str, str]) -> dict:
        """{function: FunctionReport} of the functions whose verification key has a stored verdict."""

        found = {}
        for function, key in keys.items():
            path = self.folder / VERIFIED / f"{key}.json"
            try:
                found[function] = function_report_from_json(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                continue
        return found

    def put_verified(self, reports: dict) -> None:
        """Store passing verdicts by verification key (failures are always run again)."""
        folder = self.folder / VERIFIED
        folder.mkdir(parents=True, exist_ok=True)
        for key, report in reports.items():
            if report.passed:
                temporary = folder / f".{key}.incoming"
                temporary.write_text(json.dumps(vars(report), sort_keys=True))
                os.replace(temporary, folder / f"{key}.json")

    def prune(self, manifest_name: str, keep: set[str], base_sha256: str | None = None, templates: set[str] = frozenset()) -> None:
        """Drop this manifest's entries that the latest build no longer uses, and the templates of
        its base that it did not use (palettes are kept: a rebuild after changing an adapter
        needs the base's palettes)."""
        if not self.folder.is_dir():
            return
        for record_file in (self.folder / TEMPLATES).glob("*.json") if base_sha256 else ():
            try:
                base = json.loads(record_file.read_text()).get("base")
            except (OSError, json.JSONDecodeError, AttributeError):
                base = None
            if record_file.stem not in templates and base in (base_sha256, None):
                shutil.rmtree(record_file.with_suffix(".mlpackage"), ignore_errors=True)
                record_file.unlink(missing_ok=True)
        for record_file in self.folder.glob(f"*{PART_SUFFIX}"):
            key = record_file.name[: -len(PART_SUFFIX)]
            try:
                record = json.loads(record_file.read_text())
            except (OSError, json.JSONDecodeError):
                record = {}
            if key not in keep and record.get("manifest_name") in (manifest_name, None):
                shutil.rmtree(self.folder / f"{key}.mlpackage", ignore_errors=True)
                record_file.unlink(missing_ok=True)
