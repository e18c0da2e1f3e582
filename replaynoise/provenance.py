"""The results manifest and the provenance record: what ran, on what, from which inputs.

The top of the package: it reads the configuration's deviations (``replaynoise.config``) and the file helpers
of ``replaynoise.io``.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from replaynoise.config import _fill_defaults, _fill_engine_settings, deviations, load_schema
from replaynoise.config import analysis_hash as config_hash
from replaynoise.fingerprint import environment_fingerprint, nvidia_driver
from replaynoise.io import read_json, read_manifest, sha256_file, write_text

#: Packages whose versions go into provenance.json.
TRACKED_PACKAGES = (
    "torch",
    "transformers",
    "snakemake",
    "polars",
    "statsmodels",
    "matplotlib",
    "gguf",
    "accelerate",
    "safetensors",
    "math-verify",
    "numpy",
    "vllm",
    "sglang",
)


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
    """Recompute every checksum in ``manifest``; return a line per file that is missing or differs (a malformed
    manifest: one line naming the file and line)."""
    root = Path(results_dir)
    problems = []
    try:
        entries = read_manifest(manifest)
    except (OSError, ValueError) as exc:
        return [f"MALFORMED {exc}"]
    for rel, digest in entries.items():
        path = root / rel
        if not path.exists():
            problems.append(f"MISSING {rel}")
        elif sha256_file(path) != digest:
            problems.append(f"DIFFERS {rel}")
    return problems


def verify_coverage(manifest: str | os.PathLike, expected: list[str]) -> list[str]:
    """A line per output the run's plan makes (``expected``: files, relative to the results folder) that the
    manifest does not list: a table deleted together with its manifest line leaves a manifest whose every line
    checks out."""
    try:
        listed = read_manifest(manifest)
    except (OSError, ValueError):
        return []  # verify_manifest names it
    return [
        f"UNLISTED {rel} (the run's plan makes it; the manifest has no line for it)"
        for rel in expected
        if rel not in listed
    ]


def verify_settings(provenance: str | os.PathLike, config: dict, analysis_hash: str) -> list[str]:
    """Lines where ``provenance`` does not record the settings of the run being verified: its analysis hash must be
    this configuration's and the hash of the configuration it records (an edited config no longer hashes to the
    recorded value)."""
    record = read_json(provenance)
    recorded = record.get("analysis_hash")
    problems = []
    if recorded != analysis_hash:
        problems.append(
            f"SETTINGS provenance.json records analysis hash {recorded}, this configuration's is "
            f"{analysis_hash} (verify with the configuration the run was made with)"
        )
    config_recorded = record.get("config")
    own = config_hash(config_recorded) if isinstance(config_recorded, dict) else "(no configuration)"
    if own != recorded:
        problems.append(
            f"SETTINGS provenance.json's config hashes to {own}, not to the analysis hash it records "
            f"({recorded}): it was edited after the run"
        )
    return problems


def input_checksums(paths: list[str | os.PathLike], as_read: dict[str, str] | None = None) -> dict[str, str]:
    """{path: sha256} of the files a user gave by path (dataset, local model): they live outside results/, so
    the manifest cannot cover them. ``as_read`` holds digests taken by the step that read a file, while it read
    it; they are recorded instead of the file's digest now, which an edit during the run would have changed."""
    as_read = as_read or {}
    return {str(p): as_read.get(str(p)) or sha256_file(p) for p in sorted(map(str, paths))}


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
    """The commit the workflow's source is at and whether its tree differs. Read-only: a plain ``git status``
    refreshes the user's index under ``.git/index.lock``, and a run killed at that moment would leave the lock
    behind and stop the user's next git command, so the optional locks are off."""

    def run(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=repo_dir, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    status = run("--no-optional-locks", "status", "--porcelain")
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
    return {
        "cpu_model": model or platform.processor() or None,
        "cpu_features": [f for f in KERNEL_FEATURES if f in flags],
    }


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "system": platform.system(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        **cpu_description(),
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
    info["cuda_driver"] = nvidia_driver()
    return info


def install_mode() -> str:
    """How the software environment was made: a Snakemake conda env, another conda env, or pip."""
    prefix = os.environ.get("CONDA_PREFIX", "")
    if ".snakemake/conda" in prefix:
        return "snakemake-conda"
    if prefix:
        return "conda"
    return "pip"


#: Environment variables a run's numbers depend on: the static decoder's attention kernel
#: (replaynoise.engines.hf.kernels.STATIC_ATTENTION_VARIABLE, read where torch is; named here so the record needs none).
RECORDED_VARIABLES = ("REPLAYNOISE_STATIC_ATTENTION",)


def provenance_record(
    config: dict, analysis_hash: str, repo_dir: str | os.PathLike, logs: Path | None = None, **extra: Any
) -> dict:
    """What a reviewer needs to trust the numbers: code, settings, deviations, software, hardware, seeds, and the
    environment's fingerprint (``replaynoise.fingerprint``; what the engines resolved is read from ``logs``)."""

    return {
        "git": git_commit(repo_dir),
        "analysis_hash": analysis_hash,
        "config": config,
        "deviations_from_committed_defaults": deviations(config),
        "seeds": {
            "root": config.get("seed"),
            "derivation": "blake2b(root, config, purpose, problem, pivot, branch, k) -> 63-bit",
        },
        "packages": package_versions(),
        "hardware": hardware(),
        "install_mode": install_mode(),
        # variables that change how the numbers are computed (unset: the default)
        "environment": {name: os.environ.get(name) for name in RECORDED_VARIABLES},
        "fingerprint": environment_fingerprint(config, logs),
        **extra,
    }


def _module_files(module: str, root: Path) -> list[Path]:
    """The files importing ``module`` (dotted, under ``root``) executes: its own and its packages' __init__."""
    parts, files = module.split("."), []
    for i in range(1, len(parts) + 1):
        base = root.joinpath(*parts[:i])
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if candidate.is_file():
                files.append(candidate)
    return files


@functools.lru_cache(maxsize=None)
def _imports_in(source: str, package: str) -> tuple[tuple[str, bool], ...]:
    """Cached by source text: the Snakefile asks for the closure of every rule's script at each parse, and
    they share most of their modules."""
    tree = ast.parse(source)
    at_top = {id(n) for n in tree.body} | {id(m) for n in tree.body if isinstance(n, ast.If) for m in n.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(name, id(node) in at_top) for name in names if name == package or name.startswith(package + ".")]
    return tuple(found)


def package_imports(path: str | os.PathLike, package: str = "replaynoise") -> tuple[tuple[str, bool], ...]:
    """(dotted name, imported at module level) of every import of ``package`` in the file at ``path``, function
    bodies included. ``from package.m import x`` names both ``package.m`` and ``package.m.x``, since ``x`` may
    be a module; which names are modules is for the caller to decide."""
    return _imports_in(Path(path).read_text(encoding="utf-8"), package)


def import_closure(script: str | os.PathLike, root: str | os.PathLike, package: str = "replaynoise") -> list[Path]:
    """Every file of ``package`` that running ``script`` can import, directly or through other modules, found by
    reading the imports (function bodies included: a lazy import is still code the step may run)."""
    root = Path(root)
    seen: set[Path] = set()
    todo = [Path(script)]
    while todo:
        for name, _ in package_imports(todo.pop(), package):
            for path in _module_files(name, root):
                if path not in seen:
                    seen.add(path)
                    todo.append(path)
    return sorted(seen)


def source_digest(script: str | os.PathLike, root: str | os.PathLike) -> str:
    """A digest of the library code a script runs (its import closure): editing any module in it, and no other,
    changes the digest. Scripts themselves are tracked by Snakemake."""
    digest = hashlib.sha256()
    root = Path(root)
    for path in import_closure(script, root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


#: the keys that say what a configuration is, shown whether or not they are the schema's defaults
IDENTITY = ("model", "engine", "dtype", "device", "kernels")


def configuration_differences(config: dict) -> dict[str, dict[str, Any]]:
    """Per configuration of a validated config, its ``IDENTITY`` keys and every key (dotted inside a block) whose
    value differs from what the schema fills in for a configuration of the same model, engine and device."""
    schema = load_schema()
    found: dict[str, dict[str, Any]] = {}
    for name, settings in config["configs"].items():
        bare = {"configs": {name: {k: settings[k] for k in ("model", "engine", "device") if k in settings}}}
        filled = _fill_defaults(schema, copy.deepcopy(bare))
        _fill_engine_settings(schema, filled, bare)
        prefix = f"configs.{name}."
        differing = deviations({"configs": {name: settings}}, defaults={"configs": filled["configs"]})
        found[name] = {k: settings[k] for k in IDENTITY if k in settings}
        found[name].update((d["key"].removeprefix(prefix), d["value"]) for d in differing)
    return found
