"""The environment fingerprint of a run: what besides the code and the configuration decides its bytes (the card, its
SM count and compute capability, the driver, CUDA and its math libraries, the engine's version, every engine setting
the run resolved, the load), so that two runs of one campaign that differ can be told apart by more than their
numbers. Gathered without a GPU too: what cannot be read there is None."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from replaynoise.io import read_json
from replaynoise.settings import ENGINE_BEFORE_THE_KEY

#: The package whose version decides each engine's kernels.
ENGINE_PACKAGES = {"hf": "transformers", "vllm": "vllm", "sglang": "sglang"}
#: Kernel libraries below the engines: attention, sampling and GEMM kernels come from these.
KERNEL_PACKAGES = ("triton", "flashinfer-python", "sgl-kernel", "flash-attn", "xformers")
#: cuBLAS's wheel by CUDA major version (torch does not report the cuBLAS it loads).
CUBLAS_PACKAGES = ("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12")
#: A configuration's keys, besides its engine block, that change how its numbers are computed.
NUMERIC_KEYS = (
    "device",
    "dtype",
    "kernels",
    "decode",
    "block_size",
    "kv_cache_gib",
    "cpu_matmul",
    "cpu_threads",
    "static_attention",
    "static_rows",
    "compile_rollouts",
    "invariant_rows",
    "invariant_context",
)
#: Lines the engines log at every build with what they resolved where the settings leave it open:
#: (pattern, the key a bare number is recorded under, or None for a line of key=value pairs).
LOGGED = (
    (re.compile(r"SGLang chose: (.*)$"), None),
    (re.compile(r"SGLang engine: (.*)$"), None),
    (re.compile(r"vLLM engine: (.*)$"), None),
    (re.compile(r"decode CUDA graphs for batches of up to (\d+) rows"), "cuda_graph_max_bs_decode"),
    (re.compile(r"SGLang's KV pool: (\d+) tokens"), "kv_pool_tokens"),
)
_PAIR = re.compile(r"(\w+)=(.*?)(?=, \w+=|$)")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def nvidia_smi(*fields: str) -> list[str]:
    """nvidia-smi's lines for ``fields`` (one per card, comma-separated values); none where it cannot be read."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def nvidia_driver() -> str | None:
    """The NVIDIA driver version (kernels and their numerics can change with it); None where it cannot be read."""
    return ", ".join(sorted(set(nvidia_smi("driver_version")))) or None


def _smi_cards() -> list[dict[str, Any]]:
    """The cards as nvidia-smi lists them, for an environment without torch (no SM count there)."""
    cards = []
    for line in nvidia_smi("name", "compute_cap", "memory.total"):
        name, cap, memory = [*map(str.strip, line.split(",")), None, None][:3]
        gib = round(float(memory) / 1024, 1) if memory and memory.replace(".", "").isdigit() else None
        cards.append({"name": name, "sm_count": None, "compute_capability": cap, "memory_gib": gib})
    return cards


def _torch_side() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the cards torch sees, torch's CUDA runtime and cuDNN); empty where torch or a GPU is absent."""
    try:
        import torch
    except ImportError:
        return [], {"torch": None, "cuda_runtime": None, "cudnn": None}
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    versions = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda, "cudnn": cudnn}
    if not torch.cuda.is_available():
        return [], versions
    cards = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        cards.append(
            {
                "name": p.name,
                "sm_count": p.multi_processor_count,
                "compute_capability": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / 2**30, 1),
            }
        )
    return cards, versions


def card_summary(cards: list[dict[str, Any]]) -> dict[str, Any]:
    """One record of the cards a run saw: each field's value, or the distinct values joined where cards differ."""
    summary: dict[str, Any] = {"count": len(cards)}
    for key in ("name", "sm_count", "compute_capability", "memory_gib"):
        values = sorted({str(c[key]) for c in cards if c.get(key) is not None})
        one = [c[key] for c in cards if c.get(key) is not None][:1]
        summary[key] = (one[0] if len(values) == 1 else " | ".join(values)) if values else None
    return summary


def engine_logged(config_name: str, logs: Path | None) -> dict[str, Any]:
    """What the engine resolved at its builds for ``config_name``, read from the model steps' logs under ``logs``
    (rollouts and passes: ``<rule>/<config>.<shard>.log``); a key whose value changed between builds keeps all."""
    seen: dict[str, set[str]] = {}
    name = re.compile(re.escape(config_name) + r"\.\d+\.log")
    files = sorted(p for p in logs.glob("*/*.log") if name.fullmatch(p.name)) if logs and logs.is_dir() else []
    for path in files:
        for line in path.read_text(errors="replace").splitlines():
            for pattern, key in LOGGED:
                found = pattern.search(line)
                if found is None:
                    continue
                pairs = [(key, found.group(1))] if key else _PAIR.findall(found.group(1))
                for k, v in pairs:
                    seen.setdefault(k, set()).add(v.strip())
    return {k: (next(iter(v)) if len(v) == 1 else sorted(v)) for k, v in sorted(seen.items())}


def engine_settings(settings: dict) -> dict[str, Any]:
    """A configuration's settings that change its numbers, as the configuration resolved them (its engine block
    filled with the engine's defaults; null where the engine decides, which ``engine_logged`` then records)."""
    picked = {key: settings[key] for key in NUMERIC_KEYS if key in settings}
    for block in ("vllm", "sglang"):
        if isinstance(settings.get(block), dict):
            picked[block] = dict(settings[block])
    return picked


def snakemake_load(proc: Path = Path("/proc")) -> dict[str, Any]:
    """The job count a run was started with: ``--cores``/``--jobs``/``--resources`` of the Snakemake process above
    this one (a step runs as its child); None where no such process is found (a cluster node, another system)."""
    load: dict[str, Any] = {"cores": None, "jobs": None, "resources": None}
    pid = os.getppid()
    for _ in range(6):
        try:
            argv = (proc / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
            stat = (proc / str(pid) / "stat").read_text()
        except OSError:
            return load
        if any(Path(a).name == "snakemake" or a == "snakemake" for a in argv):
            return _load_of(argv)
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            break
    return load


def _load_of(argv: list[str]) -> dict[str, Any]:
    """The job count of a Snakemake command line: its cores, jobs and global resources (None where not given)."""
    load: dict[str, Any] = {"cores": None, "jobs": None, "resources": None}
    names = {"--cores": "cores", "-c": "cores", "--jobs": "jobs", "-j": "jobs"}
    argv = [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--") else [arg])]
    for i, arg in enumerate(argv[:-1]):
        if arg in names:
            load[names[arg]] = argv[i + 1]
        elif arg in ("--resources", "--res"):
            given = []
            for value in argv[i + 1 :]:
                if value.startswith("-"):
                    break
                given.append(value)
            load["resources"] = " ".join(given) or None
    return load


def environment_fingerprint(config: dict, logs: Path | None = None) -> dict[str, Any]:
    """The fingerprint provenance.json records: the cards (None fields without a GPU), driver, CUDA runtime,
    cuBLAS, cuDNN, torch and kernel libraries, each configuration's engine with its version and numeric settings
    (and what the engine logged it resolved, from ``logs``), and the job count of the run."""
    cards, versions = _torch_side()
    cards = cards or _smi_cards()
    engines = {}
    for name, settings in sorted(config.get("configs", {}).items()):
        package = ENGINE_PACKAGES.get(settings.get("engine", ENGINE_BEFORE_THE_KEY))
        engines[name] = {
            "engine": settings.get("engine", ENGINE_BEFORE_THE_KEY),
            "package": package,
            "version": _version(package) if package else None,
            "settings": engine_settings(settings),
            "resolved": engine_logged(name, logs),
        }
    return {
        "card": card_summary(cards),
        "driver": nvidia_driver(),
        **versions,
        "cublas": next(filter(None, map(_version, CUBLAS_PACKAGES)), None),
        "libraries": {name: _version(name) for name in KERNEL_PACKAGES},
        "engines": engines,
        "load": snakemake_load(),
    }


def _present(source: dict, pairs: dict[str, str]) -> dict[str, Any]:
    """{field: source[key]} for the keys ``source`` holds (an absent key is unrecorded, not None)."""
    return {field: source[key] for field, key in pairs.items() if key in source}


def recorded_fingerprint(record: dict) -> dict[str, Any]:
    """The fingerprint a provenance.json records, with its CPU and recorded variables; for a record written before
    fingerprints, what its hardware, packages and configuration tell of the same fields (the rest unrecorded)."""
    hardware, packages = record.get("hardware") or {}, record.get("packages") or {}
    found = dict(record["fingerprint"]) if isinstance(record.get("fingerprint"), dict) else {}
    if not found:
        if "cuda" in hardware:
            cards = [{"name": name} for name in hardware["cuda"] or []]
            found["card"] = {"count": len(cards), "name": card_summary(cards)["name"]}
        found.update(_present(hardware, {"driver": "cuda_driver", "cuda_runtime": "cuda_runtime"}))
        found.update(_present(packages, {"torch": "torch"}))
        engines = {}
        for name, settings in sorted(((record.get("config") or {}).get("configs") or {}).items()):
            engine = settings.get("engine", ENGINE_BEFORE_THE_KEY)
            engines[name] = {"engine": engine, "settings": engine_settings(settings)}
            engines[name].update(_present(packages, {"version": ENGINE_PACKAGES.get(engine, "")}))
        found["engines"] = engines
    keys = ("cpu_model", "cpu_features", "torch_cpu_capability", "torch_threads")
    found["cpu"] = _present(hardware, {key: key for key in keys})
    if "environment" in record:
        found["environment"] = record["environment"]
    return found


def flat_fields(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested record as {dotted field: value}; a configuration's name is bracketed (it may hold dots)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}[{key}]" if prefix == "engines" else f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):  # an empty block holds no field
            flat.update(flat_fields(value, name))
        else:
            flat[name] = value
    return flat


#: stands for a field one record does not hold (an older provenance.json, another engine's setting)
UNRECORDED = "(not recorded)"


def fingerprint_differences(reference: dict, rerun: dict) -> tuple[list[tuple[str, Any, Any]], list[str]]:
    """(field, reference value, rerun value) of every fingerprint field the two provenance records hold with other
    values (a field only one holds: its value against ``UNRECORDED``), and the fields both hold alike."""
    ref, new = (flat_fields(recorded_fingerprint(r)) for r in (reference, rerun))
    differing = [
        (field, ref.get(field, UNRECORDED), new.get(field, UNRECORDED))
        for field in sorted(set(ref) | set(new))
        if ref.get(field, UNRECORDED) != new.get(field, UNRECORDED)
    ]
    return differing, sorted(f for f in set(ref) & set(new) if ref[f] == new[f])


def fingerprint_lines(reference: Path, rerun: Path) -> list[str]:
    """The fingerprint fields that differ between two runs' provenance.json files, one line each, for a reader
    who asks why their bytes differ (where one folder has no provenance.json, a line saying so)."""
    paths = [Path(reference) / "provenance.json", Path(rerun) / "provenance.json"]
    absent = [str(p) for p in paths if not p.is_file()]
    if absent:
        return [f"Environment fingerprint: not compared ({', '.join(absent)} missing)"]
    differing, alike = fingerprint_differences(*(read_json(p) for p in paths))
    both = [(f, a, b) for f, a, b in differing if UNRECORDED not in (a, b)]
    one = [(f, a, b) for f, a, b in differing if UNRECORDED in (a, b)]
    if not differing:
        return [f"Environment fingerprint: the {len(alike)} fields both runs record are alike"]
    lines = [
        f"Environment fingerprint: {len(both)} field(s) differ ({len(alike)} alike); field: reference -> rerun",
        *(f"  {field}: {_shown(a)} -> {_shown(b)}" for field, a, b in both),
    ]
    if one:
        lines.append(f"  recorded by one run only ({len(one)}; an older provenance.json, another engine):")
        lines += [f"    {field}: {_shown(a)} -> {_shown(b)}" for field, a, b in one]
    return lines


def _shown(value: Any) -> str:
    return value if value == UNRECORDED else repr(value)
