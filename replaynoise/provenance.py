"""Atomic writes, checksums, the results manifest and the provenance record.

Every output is written to a temporary file beside its target and renamed into place, so an interrupted
step never leaves a file that a rerun would mistake for finished work.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import subprocess
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # polars is imported by the callers; this module must also load where only torch is
    import polars as pl

#: Packages whose versions go into provenance.json.
TRACKED_PACKAGES = (
    "torch", "transformers", "snakemake", "polars", "statsmodels", "matplotlib",
    "gguf", "accelerate", "safetensors", "math-verify", "numpy", "vllm",
)


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
        os.replace(tmp_path, target)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


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


def write_parquet(df: "pl.DataFrame", target: str | os.PathLike) -> None:
    """Write a parquet file atomically. Statistics are off so equal frames give equal bytes."""
    with atomic_path(target) as tmp:
        df.write_parquet(tmp, statistics=False, compression="zstd")


class UnreadableFileError(RuntimeError):
    """An input file exists but cannot be read (truncated, corrupt); the message names it."""


def read_parquet(path: str | os.PathLike, **kwargs: Any) -> "pl.DataFrame":
    """Read a parquet file; a truncated or corrupt one raises an error naming the file, not a bare decoder error."""
    import polars as pl

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return pl.read_parquet(path, **kwargs)
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise UnreadableFileError(
            f"{path}: not a readable parquet file, truncated or corrupt ({type(exc).__name__}: {exc}); "
            "delete it and rerun the step that writes it") from None


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; a truncated or corrupt one raises an error naming the file."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UnreadableFileError(f"{path}: not readable JSON, truncated or corrupt ({exc}); "
                                  "delete it and rerun the step that writes it") from None


def write_json(obj: Any, target: str | os.PathLike) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def write_text(text: str, target: str | os.PathLike) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text)


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
            print(f"{work_dir}: discarding scratch work left by a run with other settings (key "
                  f"{stamp.read_text().strip() if stamp.is_file() else 'none'}, now {key})", file=sys.stderr)
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


def manifest_files(paths: list[str | os.PathLike]) -> list[Path]:
    """The files under ``paths`` (directories expanded), sorted and without duplicates; hidden files skipped."""
    found: set[Path] = set()
    for path in map(Path, paths):
        if path.is_dir():
            found.update(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        elif path.is_file():
            found.add(path)
        else:
            raise FileNotFoundError(f"manifest input missing: {path}")
    return sorted(found)


def write_manifest(paths: list[str | os.PathLike], root: str | os.PathLike, target: str | os.PathLike) -> int:
    """Write a ``sha256sum -c`` compatible manifest, paths relative to ``root``; return the file count."""
    root = Path(root)
    lines = [f"{sha256_file(p)}  {p.relative_to(root).as_posix()}" for p in manifest_files(paths)]
    write_text("\n".join(lines) + "\n", target)
    return len(lines)


def verify_manifest(results_dir: str | os.PathLike, manifest: str | os.PathLike) -> list[str]:
    """Recompute every checksum in ``manifest``; return a line per file that is missing or differs."""
    root = Path(results_dir)
    problems = []
    for line in Path(manifest).read_text().splitlines():
        if not line.strip():
            continue
        digest, rel = line.split("  ", 1)
        path = root / rel
        if not path.exists():
            problems.append(f"MISSING {rel}")
        elif sha256_file(path) != digest:
            problems.append(f"DIFFERS {rel}")
    return problems


def input_checksums(paths: list[str | os.PathLike]) -> dict[str, str]:
    """{path: sha256} of the files a user gave by path (dataset, local model): they live outside results/, so
    the manifest cannot hold them, and the provenance record does."""
    return {str(p): sha256_file(p) for p in sorted(map(str, paths))}


def verify_inputs(provenance: str | os.PathLike) -> list[str]:
    """A line per user-given file recorded in ``provenance`` (``inputs``) that is missing or has changed."""
    problems = []
    for path, digest in read_json(provenance).get("inputs", {}).items():
        if not Path(path).is_file():
            problems.append(f"MISSING input {path}")
        elif sha256_file(path) != digest:
            problems.append(f"DIFFERS input {path} (the results were made from another version of it)")
    return problems


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit(repo_dir: str | os.PathLike) -> dict[str, Any]:
    def run(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=repo_dir, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    status = run("status", "--porcelain")
    return {"commit": run("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


#: CPU features that decide which GEMM kernels torch and oneDNN dispatch to, and so the last bits of a CPU run's
#: logits: two machines of one "kind" (an AVX2 Intel, an AVX512-BF16 EPYC) give different rollouts.
KERNEL_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU's model name and its kernel-relevant features (``platform.processor()`` is empty on Linux)."""
    model, flags = None, set()
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # no /proc (macOS): the model name below, features unknown
        return {"cpu_model": platform.processor() or None, "cpu_features": None}
    return {"cpu_model": model or platform.processor() or None,
            "cpu_features": [f for f in KERNEL_FEATURES if f in flags]}


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {
        "machine": platform.machine(), "processor": platform.processor(), "system": platform.system(),
        "python": platform.python_version(), "cpu_count": os.cpu_count(), **cpu_description(),
    }
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        info["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda_runtime"] = torch.version.cuda
    except ImportError:  # provenance must still be written where torch is absent
        info["cuda"] = None
    # read without torch (the manifest step's environment may lack it); on the host that writes the record
    info["cuda_driver"] = nvidia_driver() if shutil.which("nvidia-smi") else None
    return info


def nvidia_driver() -> str | None:
    """The NVIDIA driver version (kernels and their numerics can change with it); None where it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    versions = sorted({line.strip() for line in out.splitlines() if line.strip()})
    return ", ".join(versions) or None


def install_mode() -> str:
    """How the software environment was made: a Snakemake conda env, another conda env, or pip."""
    prefix = os.environ.get("CONDA_PREFIX", "")
    if ".snakemake/conda" in prefix:
        return "snakemake-conda"
    if prefix:
        return "conda"
    return "pip"


def provenance_record(config: dict, analysis_hash: str, repo_dir: str | os.PathLike, **extra: Any) -> dict:
    """What a reviewer needs to trust the numbers: code, settings, deviations, software, hardware, seeds."""
    from replaynoise.config import deviations

    return {
        "git": git_commit(repo_dir),
        "analysis_hash": analysis_hash,
        "config": config,
        "deviations_from_committed_defaults": deviations(config),
        "seeds": {"root": config.get("seed"),
                  "derivation": "blake2b(root, config, purpose, problem, pivot, branch, k) -> 63-bit"},
        "packages": package_versions(),
        "hardware": hardware(),
        "install_mode": install_mode(),
        **extra,
    }
