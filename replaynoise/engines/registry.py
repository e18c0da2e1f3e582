"""The engines a configuration can name, each by its settings (read when a configuration is read: ``prepare`` before
the schema applies, ``derive`` after, ``check`` against the run), the settings block it owns, the package a job
needs, and where its engine is built (imported only when a job builds it). A new engine is one subpackage and one
entry here."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from replaynoise.engines.hf import settings as hf_settings
from replaynoise.engines.sglang import settings as sglang_settings
from replaynoise.engines.vllm import settings as vllm_settings


@dataclass(frozen=True)
class EngineEntry:
    #: ``prepare(name, settings, given, *, schema, validate, fill_defaults)``, ``derive(name, settings, replay)``,
    #: ``check(name, settings, *, controls, budget, context, heads, gpus)``
    settings: ModuleType
    #: "module:function" of ``build(settings, model_dir, *, topk, threads, startup) -> Engine``
    build: str
    #: the configuration key of its own settings (``configs.X.<block>``, filled for it alone); None: it has none
    block: str | None = None
    #: the module a job imports to build it, where it is an optional extra; refused before any job when absent
    package: str | None = None
    #: that package's name in the refusal
    package_name: str = ""
    #: what installs that package, for the refusal
    install: str = ""
    #: said of the engine where a configuration of it gives another engine's block
    foreign_block_hint: str = ""


ENGINES: dict[str, EngineEntry] = {
    "hf": EngineEntry(
        hf_settings,
        "replaynoise.engines.hf.engine:build",
        foreign_block_hint=" (tensor parallelism too: the HF engine runs on one GPU)",
    ),
    "vllm": EngineEntry(
        vllm_settings,
        "replaynoise.engines.vllm.engine:build",
        block="vllm",
        package="vllm",
        package_name="vLLM",
        install="install it (bash install.sh --vllm) and run its snakemake (.venv-vllm/bin/snakemake)",
    ),
    "sglang": EngineEntry(
        sglang_settings,
        "replaynoise.engines.sglang.engine:build",
        block="sglang",
        package="sglang",
        package_name="SGLang",
        install="install it (bash install.sh --sglang-cuda) and run its snakemake (.venv-sglang-cuda/bin/snakemake)",
    ),
}
"""Engines behind one interface (see base.py). The pipeline asks ``make_engine`` and never branches on which."""
