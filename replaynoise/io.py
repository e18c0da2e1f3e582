"""Files: atomic writes, readers that name a bad file, checksums, stable hashing and resumable scratch.

Every output is written to a temporary file beside its target and renamed into place, so an interrupted
step never leaves a file that a rerun would mistake for finished work. The bottom of the package: it imports
nothing of replaynoise.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on a folder (flock on the folder itself: no lock file is left behind), so that
    two jobs producing one shared file (a model both dtypes of a configuration need) take turns: the second
    waits, then finds the first's verified file. Locks of different folders are independent."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class FolderBusyError(RuntimeError):
    """Another process holds a folder this one must have alone; the message names the folder."""


def hold_folder(folder: str | os.PathLike) -> int:
    """Lock ``folder`` (its resolved path, so every link to it is one folder) for the rest of this process, and
    return the descriptor that holds it; the lock goes when the process ends, however it ends. Two runs whose
    results/ is one folder would otherwise each take the other's temporary files for a killed writer's."""
    resolved = Path(folder).resolve()
    resolved.mkdir(parents=True, exist_ok=True)
    fd = os.open(resolved, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FolderBusyError(
            f"{folder}: another run is using this folder ({resolved}, perhaps through a link from another working "
            "directory); wait for it to end, or give this run its own results folder"
        ) from None
    return fd


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; rename it onto ``target`` only if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.exists():
            os.chmod(tmp_path, 0o666 & ~_UMASK)  # mkstemp makes 0600; results are meant to be shared
            fsync_path(tmp_path)
        os.replace(tmp_path, target)
        fsync_path(target.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's data, or a folder's entries, to disk. A rename is durable only once both the renamed file
    and its folder are: after a power cut, an unsynced rename can leave a finished-looking file that is empty or
    cut short, or no file at all."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temporaries(target: Path) -> None:
    """Delete temporary files a killed writer of ``target`` left behind.

    SIGKILL skips the ``finally`` below, so a killed step can leave ``.NAME.XXXXXXXX.tmp`` beside its target.
    Snakemake never runs two jobs with the same output, so when the target is written again any such file
    is an orphan, and removing it keeps ``results/`` free of debris that would outlive the rerun.
    """
    pattern = re.compile(re.escape(f".{target.name}.") + r"[A-Za-z0-9_]{8}\.tmp")
    for sibling in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        if pattern.fullmatch(sibling.name):
            with contextlib.suppress(FileNotFoundError):
                sibling.unlink()


def file_in(folder: str | os.PathLike, name: str) -> Path:
    """``folder / name``, refusing a name that would put the file anywhere else (a separator, ``..``, an absolute
    path): file names made from input data (a problem id) must never write outside the step's folder."""
    path = Path(folder) / name
    if not name or name in (".", "..") or Path(name).name != name or path.parent != Path(folder):
        raise ValueError(f"{name!r}: not a plain file name, so it would not stay in {folder}")
    return path


def write_parquet(df: pl.DataFrame, target: str | os.PathLike) -> None:
    """Write a parquet file atomically. Statistics are off so equal frames give equal bytes."""
    with atomic_path(target) as tmp:
        df.write_parquet(tmp, statistics=False, compression="zstd")


class UnreadableFileError(RuntimeError):
    """An input file exists but cannot be read (truncated, corrupt); the message names it."""


def read_parquet(path: str | os.PathLike, **kwargs: Any) -> pl.DataFrame:
    """Read a parquet file; a truncated or corrupt one raises an error naming the file, not a bare decoder error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return pl.read_parquet(path, **kwargs)
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise UnreadableFileError(
            f"{path}: not a readable parquet file, truncated or corrupt ({type(exc).__name__}: {exc}); "
            "delete it and rerun the step that writes it"
        ) from None


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; a truncated or corrupt one raises an error naming the file."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except ValueError as exc:  # a decoding error, invalid UTF-8, or a number past Python's digit limit
        raise UnreadableFileError(
            f"{path}: not readable JSON, truncated or corrupt ({exc}); delete it and rerun the step that writes it"
        ) from None


def write_json(obj: Any, target: str | os.PathLike) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def write_text(text: str, target: str | os.PathLike) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text)


def intact_scratch(path: str | os.PathLike) -> bool:
    """Whether a step's scratch batch (a parquet file a killed or crashed run left) can be resumed from. A
    damaged one is named in the log and deleted, so the step redoes that batch instead of failing on it at every
    rerun."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        pl.read_parquet(path)
    except (pl.exceptions.PolarsError, OSError) as exc:
        print(f"{path}: damaged scratch batch, redoing it ({type(exc).__name__}: {exc})", file=sys.stderr)
        path.unlink()
        return False
    return True


def remove_scratch(work_dir: str | os.PathLike) -> None:
    """Drop a step's resumable scratch work once its outputs are written."""
    shutil.rmtree(work_dir, ignore_errors=True)


def keyed_scratch(work_dir: str | os.PathLike, key: str) -> Path:
    """A step's scratch folder, keyed by what produced it: work left by a run with other settings (``key``: a
    hash of everything that decides the content) is discarded, and the log says so, instead of being resumed."""
    work_dir = Path(work_dir)
    stamp = work_dir / ".key"
    if work_dir.exists() and (not stamp.is_file() or stamp.read_text().strip() != key):
        if any(p.name != ".key" for p in work_dir.iterdir()):
            print(
                f"{work_dir}: discarding scratch work left by a run with other settings (key "
                f"{stamp.read_text().strip() if stamp.is_file() else 'none'}, now {key})",
                file=sys.stderr,
            )
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(key + "\n")
    return work_dir


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: str | os.PathLike, expected: str, label: str | None = None) -> None:
    """Fail with the file's name and both digests when a pinned file does not match. ``label``: what to call the
    file instead, where it is a temporary the user never sees (a download, an extraction, an assembly)."""
    actual = sha256_file(path)
    if actual != expected:
        raise ChecksumError(f"checksum mismatch for {label or path}: expected sha256 {expected}, got {actual}")


class ChecksumError(RuntimeError):
    """A file does not have the sha256 it is pinned to."""


def stable_hash(obj: Any) -> str:
    """A short hash of a JSON-able object, independent of key order."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


#: A ``sha256sum`` line: 64 hex digits, a space, a space (text) or '*' (binary), the path.
MANIFEST_LINE = re.compile(r"([0-9a-fA-F]{64}) [ *](.+)")
#: What ends a line for str.splitlines besides "\n" (U+2028, U+0085, ...): never a line break to sha256sum, so
#: never in a name that becomes a manifest line (a problem id, a configuration name).
LINE_BREAKS = re.compile(r"[\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def read_manifest(path: str | os.PathLike) -> dict[str, str]:
    """A ``sha256sum`` manifest as {relative path: digest}, read as ``sha256sum -c`` reads it: lines end at "\\n"
    alone, each holds a digest, a space, a space or '*', and the path. Anything else is refused by file and line
    (a reviewer's check must name a bad line, never crash on it)."""
    entries: dict[str, str] = {}
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from None
    for number, line in enumerate(text.split("\n"), 1):
        if not line:
            continue
        match = MANIFEST_LINE.fullmatch(line)
        if match is None:
            raise ValueError(f"{path}:{number}: not a sha256sum line: {line[:120]!r}")
        if match.group(2) in entries:
            raise ValueError(f"{path}:{number}: {match.group(2)!r} is listed twice")
        entries[match.group(2)] = match.group(1).lower()
    return entries


def json_field(record: Any, source: str | os.PathLike, *keys: str) -> Any:
    """``record[keys[0]][keys[1]]...``, or an error naming the file and the field a reader needed."""
    node = record
    for depth, key in enumerate(keys):
        if not isinstance(node, dict) or key not in node:
            raise ValueError(f"{source}: field {'.'.join(keys[: depth + 1])} missing")
        node = node[key]
    return node
