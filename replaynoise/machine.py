"""What the machine a run starts on, or a cluster's node, must offer: the GPUs a model job holds, vLLM or SGLang where
a configuration names it, and whether an overlay also runs the default configurations. Checked by the Snakefile
before the first job, which would otherwise fail on it after seconds to minutes with a raw traceback."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import yaml

from replaynoise.config import DEFAULT_CONFIG_PATH, tensor_parallel_size
from replaynoise.engines.registry import ENGINES


def job_gpus(settings: dict) -> int:
    """GPUs a model job of a configuration holds: its tensor parallelism on cuda, none on a CPU."""
    return tensor_parallel_size(settings) if settings["device"].startswith("cuda") else 0


def platform_problems(config: dict, *, conda: bool = False, dev: Path = Path("/dev")) -> list[str]:
    """What this machine lacks for the configurations (vLLM for engine vllm, unless conda builds its env; a GPU
    for device cuda), each naming its key: checked before the first job, which would fail on it after seconds
    to minutes with a raw traceback. Only for jobs that run here, not on a cluster's nodes."""
    problems = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = len(list(dev.glob("nvidia[0-9]*")))
    if visible is not None:
        gpus = min(gpus, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))
    other_gpu = (dev / "dxg").exists() or (dev / "kfd").exists()  # WSL2's and ROCm's devices
    for name, settings in sorted(config["configs"].items()):
        entry = ENGINES.get(settings["engine"])
        if entry is not None and entry.package and not conda and importlib.util.find_spec(entry.package) is None:
            problems.append(
                f"config key configs.{name}.engine: {settings['engine']!r}, but {entry.package_name} is "
                f"not installed for this interpreter; {entry.install}, or run with --use-conda"
            )
        device = settings["device"]
        if device.startswith("cuda") and not other_gpu:
            index = int(device.split(":")[1]) if ":" in device else 0
            if index >= gpus:
                problems.append(
                    f"config key configs.{name}.device: {device!r}, but this machine shows "
                    f"{gpus} NVIDIA GPU(s) (/dev/nvidia*, CUDA_VISIBLE_DEVICES={visible}); use "
                    "device: cpu, or run where the GPU is"
                )
    return problems


def overlay_adds_default_configs(overlays: list[dict]) -> list[str]:
    """The default configuration names an overlay run also runs: Snakemake merges an overlay's ``configs`` into
    those of config/config.yaml unless --replace-workflow-config is given."""
    named = {name for overlay in overlays for name in (overlay or {}).get("configs", {}) or {}}
    if not named:
        return []
    defaults = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text()).get("configs", {})
    return sorted(set(defaults) - named)
