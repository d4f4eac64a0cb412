"""The build cache: parts, converted bases, palettes, value checks and verdicts on disk, keyed by
content.

A cache directory is input from outside the build (CI restores it from storage that another
branch's workflow may have written, a partial restore can truncate it, a runner's disk can rot
it), so nothing in it is trusted as found:

- every entry is a folder ``KIND/KEY/`` holding its files and ``entry.json``: what wrote it, and
  the size and SHA-256 of each file, computed when the entry is written;
- an entry is written whole under a temporary name and renamed into place, so readers (other
  builds sharing the folder) see a complete entry or none; when two builds write one key, the
  first rename wins and the second discards its copy (the same inputs gave the same bytes);
- reuse re-hashes every file, streaming, and compares: a missing, extra or changed file is a
  one-line warning naming the entry, which is dropped (renamed away, then deleted, so never left
  half-deleted) and built again;
- a verdict is keyed by the digest of the function's bytes as they land in the package (and the
  inputs its reference came from), so it vouches for exactly the bytes it was given.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from adapterpack.assemble.parts import PartRecord, link_or_copy, place
from adapterpack.verification.reports import function_report_from_json

log = logging.getLogger(__name__)


ENTRY_FILE = "entry.json"


# The mark a build leaves in a folder it made its cache: the cache commands (info, verify, prune)
# act on no other folder, so a slip (`cache prune build`, the output folder) deletes nothing. The
# Cache Directory Tagging Specification's file, which backup tools also honour.
MARKER = "CACHEDIR.TAG"
MARKER_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This folder is an adapterpack build cache: entries are rebuilt when missing.\n"
    "# `adapterpack cache info|verify|prune` act only on folders holding this file.\n"
)


def cache_holding(path: Path) -> Path | None:
    """The marked build cache ``path`` is or lies inside, or None: no output may be written
    there (a later ``cache verify`` or ``prune`` would drop it as a damaged entry)."""
    for folder in (Path(path), *Path(path).parents):
        if is_marked(folder):
            return folder
    return None


def is_marked(folder: Path) -> bool:
    """Whether ``folder`` is a build cache a build made (it holds ``MARKER``)."""
    try:
        return (Path(folder) / MARKER).read_text().startswith(MARKER_TEXT.splitlines()[0])
    except (OSError, UnicodeDecodeError):
        return False


# Bump when an entry's layout changes; entries of another layout are stale, never read.
ENTRY_LAYOUT = 1


# What each kind of entry holds (the names ``cache info`` shows).
KINDS = {
    "parts": "one function's compressed program (a part)",
    "bases": "the base converted once, uncompressed or compressed",
    "palettes": "a weight's palettes (4-bit etc.), reused when it is palettized again",
    "checks": "the base's largest weight magnitudes (the float16 range check)",
    "calibration": "activation statistics of the calibration texts (data-aware palettes), or the texts the base wrote",
    "verdicts": "a passing verification, for the exact bytes it was given",
}


PART_PACKAGE = "part.mlpackage"
BASE_PACKAGE = "base.mlpackage"


# Hashing threads: hashlib releases the GIL, so entries re-hash on both cores.
HASH_WORKERS = 2


# Temporary folders older than this are left by a build that was killed, not one that is writing.
STALE_SECONDS = 24 * 3600


# A file is hashed in pieces of this size, side by side on both cores: one large weight file
# (a part of a 1B model is 0.7 GB) would otherwise keep one core busy and the other idle.
HASH_PIECE = 1 << 26
_READ = 1 << 22


def file_digests(path: Path) -> list[str]:
    """SHA-256 of each ``HASH_PIECE``-byte piece of a file, in order (one for a small file)."""
    size = path.stat().st_size
    pieces = [(offset, min(HASH_PIECE, size - offset)) for offset in range(0, size, HASH_PIECE)] or [(0, 0)]
    with path.open("rb") as handle:
        descriptor = handle.fileno()

        def piece(span: tuple[int, int]) -> str:
            offset, length = span
            digest = hashlib.sha256()
            done = 0
            while done < length:
                data = os.pread(descriptor, min(_READ, length - done), offset + done)
                if not data:
                    raise OSError(f"{path} ended at byte {offset + done} while being hashed")
                digest.update(data)
                done += len(data)
            return digest.hexdigest()

        if len(pieces) == 1:
            return [piece(pieces[0])]
        with ThreadPoolExecutor(HASH_WORKERS) as pool:
            return list(pool.map(piece, pieces))


def _file_digests_once(path: Path, hashed: dict | None) -> list[str]:
    """``file_digests``, remembered in ``hashed`` by the file's identity and change time (a file
    linked into several entries is one file)."""
    if hashed is None:
        return file_digests(path)
    stat = path.stat()
    identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    # entries are checked side by side: the second to reach a shared file waits for the first
    with hashed.setdefault(("lock", identity), threading.Lock()):
        if identity not in hashed:
            hashed[identity] = file_digests(path)
    return hashed[identity]


def _piece_digests(data: bytes) -> list[str]:
    """``file_digests`` of bytes in memory."""
    view = memoryview(data)
    return [hashlib.sha256(view[o : o + HASH_PIECE]).hexdigest() for o in range(0, len(data), HASH_PIECE)] or [
        hashlib.sha256(b"").hexdigest()
    ]


def _payload_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() != ENTRY_FILE)


def _digests(folder: Path) -> dict[str, list]:
    """{relative path: [size, [sha256 of each piece]]} of every payload file under ``folder``."""
    files = _payload_files(folder)
    with ThreadPoolExecutor(HASH_WORKERS) as pool:
        hashes = list(pool.map(file_digests, files))
    return {f.relative_to(folder).as_posix(): [f.stat().st_size, h] for f, h in zip(files, hashes)}


@dataclass
class Entry:
    """One entry on disk, as ``entry.json`` describes it."""

    kind: str
    key: str
    folder: Path
    about: dict  # what wrote it: a part's record, a base's digest, ...
    files: dict[str, list]  # relative path -> [size, [sha256 of each HASH_PIECE bytes]]
    last_used: float  # seconds since the epoch: entry.json's modification time

    @property
    def size(self) -> int:
        return sum(size for size, _ in self.files.values())

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.key[:16]}"

    def stored(self) -> dict[tuple[int, int], int]:
        """{(device, inode): bytes} of its files as they are on disk: a file hard-linked into
        several entries (a fused part shares the compressed base's blob) is one key."""
        found = {}
        for path in _payload_files(self.folder):
            try:
                stat = path.stat()
            except OSError:
                continue
            found[stat.st_dev, stat.st_ino] = stat.st_size
        return found

    def problem(self, *, sizes_only: bool = False, hashed: dict | None = None) -> str | None:
        """Why the files on disk are not the ones recorded (None when they are). ``hashed``:
        digests already computed by this process, by file identity (a fused part's blob is the
        compressed base's, linked: read once, not once per entry)."""
        present = {f.relative_to(self.folder).as_posix(): f for f in _payload_files(self.folder)}
        missing = sorted(set(self.files) - set(present))
        if missing:
            return f"{missing[0]} is missing"
        extra = sorted(set(present) - set(self.files))
        if extra:
            return f"{extra[0]} is not one of its files"
        for name, (size, _) in sorted(self.files.items()):
            if present[name].stat().st_size != size:
                return f"{name} has {present[name].stat().st_size:,} bytes, {size:,} were written"
        if sizes_only:
            return None
        names = sorted(self.files)
        with ThreadPoolExecutor(HASH_WORKERS) as pool:
            hashes = list(pool.map(lambda n: _file_digests_once(present[n], hashed), names))
        for name, found in zip(names, hashes):
            recorded = self.files[name][1]
            if found != recorded:
                piece = next((i for i, (a, b) in enumerate(zip(found, recorded)) if a != b), 0)
                return (
                    f"{name} is not the file that was written (sha256 of bytes {piece * HASH_PIECE:,}-"
                    f"{min((piece + 1) * HASH_PIECE, self.files[name][0]):,} differs)"
                )
        return None


@dataclass(frozen=True)
class Repaired:
    """What ``BuildCache.repair`` found: entries intact, and damaged ones it dropped."""

    intact: int
    damaged: int


class BuildCache:
    """Entries by kind and content key under ``folder`` (default: ``.adapterpack-cache`` beside
    the output). ``warn(line)`` reports a damaged entry (default: the log)."""

    def __init__(self, folder: Path, warn: Callable[[str], None] | None = None):
        self.folder = Path(folder)
        self.warn = warn or log.warning
        self._hashed: dict = {}  # file identity -> digests this process computed (Entry.problem)
        self._marked = False

    def mark(self) -> None:
        """Make the folder (when missing) and mark it as a build cache (``MARKER``)."""
        if self._marked:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        if not is_marked(self.folder):
            staged = self.folder / f".{MARKER}.{uuid.uuid4().hex}"
            staged.write_text(MARKER_TEXT)
            os.replace(staged, self.folder / MARKER)
        self._marked = True

    # -- entries ---------------------------------------------------------------------------

    def _read(self, folder: Path, kind: str) -> Entry | None:
        try:
            data = json.loads((folder / ENTRY_FILE).read_text())
            if data.get("layout") != ENTRY_LAYOUT or not isinstance(data.get("files"), dict):
                return None
            return Entry(kind, folder.name, folder, data.get("about") or {}, data["files"], (folder / ENTRY_FILE).stat().st_mtime)
        except (OSError, ValueError, AttributeError):
            return None

    def entries(self, kinds: Iterable[str] = KINDS) -> Iterator[Entry | Path]:
        """Every entry; a folder that is not a readable entry is yielded as its path."""
        for kind in kinds:
            root = self.folder / kind
            if not root.is_dir():
                continue
            for folder in sorted(root.iterdir()):
                if folder.name.startswith(".") or not folder.is_dir():
                    continue
                yield self._read(folder, kind) or folder

    def open(self, kind: str, key: str) -> Path | None:
        """The folder of entry ``kind/key`` after its files were re-hashed and found as written;
        None when there is none (a damaged one is reported and dropped)."""
        return self.open_many(kind, [key]).get(key)

    def open_many(self, kind: str, keys: Iterable[str]) -> dict[str, Path]:
        """``open`` for several keys, the entries re-hashed side by side on both cores."""
        found = {}
        for key in keys:
            folder = self.folder / kind / key
            if not folder.is_dir():
                continue
            entry = self._read(folder, kind)
            if entry is None:
                self.warn(f"build cache: {kind}/{key[:16]} has no readable {ENTRY_FILE} (an interrupted copy?): dropped, built again")
                self.drop(folder)
                continue
            found[key] = entry
        if len(found) > 1:
            with ThreadPoolExecutor(HASH_WORKERS) as pool:
                problems = dict(zip(found, pool.map(lambda e: e.problem(hashed=self._hashed), found.values())))
        else:
            problems = {key: entry.problem(hashed=self._hashed) for key, entry in found.items()}
        return {key: entry.folder for key, entry in found.items() if self._accept(entry, problems[key])}

    def _accept(self, entry: Entry, problem: str | None) -> bool:
        """Whether to use ``entry``: a damaged one is reported and dropped; a sound one is
        marked as used now."""
        if problem is not None:
            self.warn(f"build cache: {entry.name} is damaged ({problem}): dropped, built again")
            self.drop(entry.folder)
            return False
        try:
            os.utime(entry.folder / ENTRY_FILE)  # last use, for pruning the least recently used
        except OSError:
            pass
        return True

    def read_file(self, kind: str, key: str, name: str) -> bytes | None:
        """The one file ``name`` of entry ``kind/key``, read once and checked against its recorded
        digests in memory (a small entry: palettes, a check, a verdict); None when there is none
        or it is damaged (reported and dropped)."""
        folder = self.folder / kind / key
        if not folder.is_dir():
            return None
        entry = self._read(folder, kind)
        if entry is None:
            self.warn(f"build cache: {kind}/{key[:16]} has no readable {ENTRY_FILE} (an interrupted copy?): dropped, built again")
            self.drop(folder)
            return None
        problem = entry.problem(sizes_only=True)
        data = b""
        if problem is None:
            try:
                data = (folder / name).read_bytes()
            except OSError as error:
                problem = f"{name} cannot be read ({error.strerror or error})"
        if problem is None and _piece_digests(data) != entry.files.get(name, [0, []])[1]:
            problem = f"{name} is not the file that was written"
        return data if self._accept(entry, problem) else None

    def write(self, kind: str, key: str, files: Mapping[str, Path | bytes], about: dict) -> Path:
        """Store ``files`` (name -> a file or package folder to copy, or bytes) as entry
        ``kind/key``, atomically; returns the entry's folder. An entry already there (another
        build wrote the same key) is kept."""
        self.mark()
        root = self.folder / kind
        root.mkdir(parents=True, exist_ok=True)
        incoming = root / f".incoming-{uuid.uuid4().hex}"
        incoming.mkdir()
        try:
            for name, source in files.items():
                target = incoming / name
                if isinstance(source, bytes):
                    target.write_bytes(source)
                elif source.is_dir():
                    place(source, target)
                else:
                    link_or_copy(source, target)
            record = {"layout": ENTRY_LAYOUT, "kind": kind, "key": key, "about": about, "files": _digests(incoming)}
            (incoming / ENTRY_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
            final = root / key
            try:
                os.rename(incoming, final)
            except OSError:
                if not (final / ENTRY_FILE).is_file():
                    raise
                shutil.rmtree(incoming, ignore_errors=True)  # another build wrote it first
            return final
        except BaseException:
            shutil.rmtree(incoming, ignore_errors=True)
            raise

    def repair(self, report: Callable[[str], None]) -> Repaired:
        """Re-hash every entry against the SHA-256 recorded when it was written; drop each damaged
        or unreadable one (the next build makes it again), saying so through ``report``."""
        intact = damaged = 0
        for entry in self.entries():
            if not isinstance(entry, Entry):
                report(f"{entry}: not a readable entry: dropped")
                self.drop(entry)
                damaged += 1
                continue
            problem = entry.problem(hashed=self._hashed)
            if problem is None:
                intact += 1
                continue
            report(f"{entry.name}: damaged ({problem}): dropped")
            self.drop(entry.folder)
            damaged += 1
        return Repaired(intact=intact, damaged=damaged)

    def drop(self, folder: Path) -> None:
        """Remove an entry: renamed out of its kind's namespace first, so no reader ever finds it
        half-deleted, then deleted."""
        trash = self.folder / f".trash-{uuid.uuid4().hex}"
        try:
            os.rename(folder, trash)
        except OSError:
            return  # already gone (another build dropped it)
        shutil.rmtree(trash, ignore_errors=True)

    def clean_leftovers(self, older_than: float = STALE_SECONDS) -> None:
        """Delete temporary folders that killed builds left (never a running build's)."""
        now = time.time()
        candidates = list(self.folder.glob(".trash-*")) + [p for kind in KINDS for p in (self.folder / kind).glob(".incoming-*")]
        candidates += list(self.folder.glob(f".{MARKER}.*"))
        for path in candidates:
            try:
                if now - path.stat().st_mtime >= older_than:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                continue

    # -- what the build stores -------------------------------------------------------------

    def parts(self, keys: Iterable[str]) -> dict[str, Path]:
        return {key: folder / PART_PACKAGE for key, folder in self.open_many("parts", keys).items()}

    def put_part(self, key: str, package: Path, record: PartRecord) -> None:
        self.write("parts", key, {PART_PACKAGE: package}, record.as_json())

    def template(self, key: str) -> Path | None:
        """A converted (and possibly compressed) base, by key; see ``builder._PartBuilder``."""
        folder = self.open("bases", key)
        return folder / BASE_PACKAGE if folder is not None else None

    def put_template(self, key: str, package: Path, base_sha256: str) -> None:
        self.write("bases", key, {BASE_PACKAGE: package}, {"base": base_sha256})

    def checks(self, key: str) -> dict | None:
        data = self.read_file("checks", key, "check.json")
        try:
            return json.loads(data) if data is not None else None
        except ValueError:
            return None

    def put_checks(self, key: str, result: dict, base_sha256: str) -> None:
        self.write("checks", key, {"check.json": json.dumps(result, sort_keys=True).encode()}, {"base": base_sha256})

    def verified(self, keys: dict[str, str]) -> dict:
        """{function: FunctionReport} of the functions whose verdict key has a stored verdict."""
        opened = self.open_many("verdicts", keys.values())
        found = {}
        for function, key in keys.items():
            if key in opened:
                try:
                    found[function] = function_report_from_json(json.loads((opened[key] / "verdict.json").read_text()))
                except (OSError, ValueError, TypeError):
                    continue
        return found

    def put_verified(self, reports: dict) -> None:
        """Store passing verdicts by verdict key (failures are always run again)."""
        for key, report in reports.items():
            if report.passed:
                payload = json.dumps(vars(report), sort_keys=True).encode()
                self.write("verdicts", key, {"verdict.json": payload}, {"function": report.name, "digest": report.digest})

    def palette_files(self) -> CachedPalettes:
        return CachedPalettes(self)

    # -- pruning ---------------------------------------------------------------------------

    def prune_build(self, manifest_name: str, keep: set[str], base_sha256: str | None = None, templates: set[str] = frozenset()) -> None:
        """After a build: drop this manifest's parts that it no longer uses, and the converted
        bases of its base that it did not use (palettes, checks and verdicts stay: a rebuild
        after changing an adapter back needs them; ``cache prune`` bounds them)."""
        for entry in self.entries(("parts", "bases")):
            if not isinstance(entry, Entry):
                continue
            if entry.kind == "parts" and entry.key not in keep and entry.about.get("manifest_name") == manifest_name:
                self.drop(entry.folder)
            elif entry.kind == "bases" and base_sha256 and entry.key not in templates and entry.about.get("base") == base_sha256:
                self.drop(entry.folder)

    def prune(self, *, max_bytes: int | None = None, older_than_days: float | None = None) -> list[Entry | Path]:
        """Drop entries unused for ``older_than_days``, then the least recently used until the
        cache holds at most ``max_bytes``; also unreadable entries, files of an older layout
        and leftovers of killed builds. Returns what was dropped."""
        dropped: list[Entry | Path] = []
        entries = []
        for entry in self.entries():
            if isinstance(entry, Entry):
                entries.append(entry)
            else:
                dropped.append(entry)
                self.drop(entry)
        for path in self.legacy():
            dropped.append(path)
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        self.clean_leftovers()
        entries.sort(key=lambda e: e.last_used)
        if older_than_days is not None:
            limit = time.time() - older_than_days * 86400
            while entries and entries[0].last_used < limit:
                dropped.append(entries.pop(0))
                self.drop(dropped[-1].folder)
        if max_bytes is not None:
            # a file several entries link frees its bytes with the last of them
            stored = {id(e): e.stored() for e in entries}
            holders = Counter(inode for files in stored.values() for inode in files)
            sizes = {inode: size for files in stored.values() for inode, size in files.items()}
            total = sum(sizes.values())
            while entries and total > max_bytes:
                oldest = entries.pop(0)
                for inode in stored[id(oldest)]:
                    holders[inode] -= 1
                    if not holders[inode]:
                        total -= sizes[inode]
                dropped.append(oldest)
                self.drop(oldest.folder)
        return dropped

    def legacy(self) -> list[Path]:
        """Files an older adapterpack's cache layout left (never read by this one)."""
        found = [p for p in self.folder.glob("*.mlpackage")] + list(self.folder.glob("*.part.json"))
        found += [p for p in (self.folder / "templates", self.folder / "verified") if p.exists()]
        found += list((self.folder / "palettes").glob("*.npz"))
        return sorted(found)


class CachedPalettes:
    """The palette store's files (``compress.palettes.PaletteFiles``) as cache entries."""

    def __init__(self, cache: BuildCache):
        self.cache = cache

    def read(self, key: str) -> bytes | None:
        return self.cache.read_file("palettes", key, "palettes.npz")

    def write(self, key: str, data: bytes) -> None:
        self.cache.write("palettes", key, {"palettes.npz": data}, {})


class FolderPalettes:
    """The palette store's files in a build's own working folder (nobody else writes there)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def read(self, key: str) -> bytes | None:
        try:
            return (self.folder / f"{key}.npz").read_bytes()
        except OSError:
            return None

    def write(self, key: str, data: bytes) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"{key}.npz").write_bytes(data)
