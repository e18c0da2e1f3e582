"""The engines a configuration can name, each by its settings (read when a configuration is read: ``prepare`` before
the schema applies, ``derive`` after, ``check`` against the run) and by where its engine is built (imported only
when a job builds it). A new engine is one subpackage and one line here."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from replaynoise.engines.hf import settings as hf_settings
from replaynoise.engines.vllm import settings as vllm_settings


@dataclass(frozen=True)
class EngineEntry:
    #: ``prepare(name, settings, given, *, schema, validate, fill_defaults)``, ``derive(name, settings, replay)``,
    #: ``check(name, settings, *, controls, budget, context, heads, gpus)``
    settings: ModuleType
    #: "module:function" of ``build(settings, model_dir, *, topk, threads, startup) -> Engine``
    build: str


ENGINES: dict[str, EngineEntry] = {
    "hf": EngineEntry(hf_settings, "replaynoise.engines.hf.engine:build"),
    "vllm": EngineEntry(vllm_settings, "replaynoise.engines.vllm.engine:build"),
}
