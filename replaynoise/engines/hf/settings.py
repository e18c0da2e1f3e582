"""The HF engine's settings, read when a configuration is read (no torch import): the one decoder shape of an
invariant configuration that decodes statically."""

from __future__ import annotations

import os
from typing import Any

from replaynoise.settings import INVARIANT_PROMPT, INVARIANT_ROWS, ConfigError

#: the stock static decoders' attention and the invariant decoder's (``kernels.static_attention`` says why), and
#: the variable that overrides both for a run where a configuration names none
STATIC_ATTENTION = "gemm"
INVARIANT_ATTENTION = "sdpa"
STATIC_ATTENTION_VARIABLE = "REPLAYNOISE_STATIC_ATTENTION"


def prepare(name: str, settings: dict, given: dict, **_: Any) -> None:
    """Nothing to fill: the HF engine has no settings block (another engine's is refused by ``config``)."""


def decodes_statically(settings: dict) -> bool:
    """Whether a configuration decodes with a static decoder: ``decode: static``, or ``auto`` off the CPU (the
    engine falls back to dynamic decode for model families the static decoder does not cover)."""
    return settings["decode"] == "static" or (settings["decode"] == "auto" and settings["device"] != "cpu")


def derive(name: str, settings: dict, replay: dict) -> None:
    """The one decoder shape of an HF invariant configuration that decodes statically (``decode: static``, or
    ``auto`` off the CPU), filled in where not given, so that the rollouts and every pass (which all receive
    the configuration's settings) build the same one. Others are left as they are: their settings, and so the
    analysis hash of a committed run, stay what they were before the invariant decoder existed."""
    if settings["kernels"] == "invariant" and decodes_statically(settings):
        settings.setdefault("invariant_rows", INVARIANT_ROWS)
        continuation = max(replay["max_new_tokens"], replay["probe_tokens"])
        budget = settings["max_new_tokens"] + continuation
        settings.setdefault("invariant_context", -(-(budget + INVARIANT_PROMPT) // 256) * 256)
        if settings["invariant_context"] <= budget:
            raise ConfigError(
                f"config key configs.{name}.invariant_context: {settings['invariant_context']} slots do not hold "
                f"a prompt plus {settings['max_new_tokens']} rollout and {continuation} continuation tokens"
            )


#: static decoders' attentions that run on a GPU alone (``static_attention``)
GPU_ATTENTIONS = {"fa3": "FlashAttention 3, Hopper", "efficient": "PyTorch's memory-efficient attention"}


def check(name: str, settings: dict, **_: Any) -> None:
    """``static_rows``, ``compile_rollouts`` and ``static_attention`` shape the stock static decoder alone: with
    invariant kernels (``invariant_rows``) or a dynamic decode (``decode: dynamic``, or ``auto`` on the CPU) they
    would change nothing, so they are refused; so are ``compile_rollouts`` on the CPU, where nothing is compiled,
    and ``static_attention`` naming a GPU kernel there."""
    for key, what in (
        ("static_rows", "sizes"),
        ("compile_rollouts", "compiles"),
        ("static_attention", "chooses the attention of"),
    ):
        if key in settings and (settings["kernels"] != "stock" or not decodes_statically(settings)):
            raise ConfigError(
                f"config key configs.{name}.{key}: {what} the stock static decoder, and this configuration "
                f"decodes with kernels {settings['kernels']!r} and decode {settings['decode']!r} on "
                f"{settings['device']!r} (invariant kernels take invariant_rows; decode static, or auto on a GPU, "
                "is the static decoder); remove it"
            )
    if settings.get("static_attention") in GPU_ATTENTIONS and settings["device"] == "cpu":
        raise ConfigError(
            f"config key configs.{name}.static_attention: {settings['static_attention']} is a GPU kernel "
            f"({GPU_ATTENTIONS[settings['static_attention']]}), and this configuration runs on 'cpu'; choose gemm or "
            "sdpa there, or remove the key"
        )
    variable = os.environ.get(STATIC_ATTENTION_VARIABLE)
    if variable is not None and settings.get("static_attention", variable) != variable:
        raise ConfigError(
            f"config key configs.{name}.static_attention: {settings['static_attention']}, and the run's "
            f"{STATIC_ATTENTION_VARIABLE} says {variable}; unset the variable or change the key"
        )
    if settings.get("compile_rollouts") and settings["device"] == "cpu":
        raise ConfigError(
            f"config key configs.{name}.compile_rollouts: compiles the static decoder's CUDA step, and this "
            "configuration runs on 'cpu', where the decoder runs eagerly; remove it"
        )


def attention_variable(settings: dict) -> dict[str, str]:
    """The run's ``REPLAYNOISE_STATIC_ATTENTION`` as a setting of an hf configuration's model steps, where it names
    another attention than the configuration's default: the steps' parameters then hold it, so that setting or
    changing the variable reruns them and a resumed run never mixes kernels. Empty where it changes nothing."""
    variable = os.environ.get(STATIC_ATTENTION_VARIABLE)
    default = INVARIANT_ATTENTION if settings.get("kernels") == "invariant" else STATIC_ATTENTION
    if settings.get("engine") != "hf" or variable is None or variable == settings.get("static_attention", default):
        return {}
    return {"attention_variable": variable}
