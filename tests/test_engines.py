"""Engines are interchangeable: every registered engine builds through the registry and offers what the pipeline
asks of an engine (``engines.base.Engine``), each checks its own settings, and the HF decode modes share one
declared interface. A new engine is one subpackage and one registry line; this is what it must satisfy."""

from __future__ import annotations

import importlib
import inspect

import pytest

from replaynoise.engines.base import Engine, PrefixKind, PrefixSource, as_source
from replaynoise.engines.hf.invariant_modes import Aligned, ByToken
from replaynoise.engines.hf.modes import DecodeMode, Dynamic, Static
from replaynoise.engines.registry import ENGINES

PROTOCOL_METHODS = [name for name, value in vars(Engine).items() if callable(value) and not name.startswith("_")]


def engine_class(name: str) -> type:
    module, function = ENGINES[name].build.split(":")
    build = getattr(importlib.import_module(module), function)
    return inspect.signature(build, eval_str=True).return_annotation


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_offers_what_the_pipeline_asks_of_one(name):
    cls = engine_class(name)
    assert cls.name == name
    assert PROTOCOL_METHODS == ["generate_rollouts", "run_batch"]
    for method in PROTOCOL_METHODS:
        wanted = list(inspect.signature(getattr(Engine, method)).parameters)
        assert list(inspect.signature(getattr(cls, method)).parameters) == wanted, (name, method)
    for attribute in ("tokenizer", "stop_ids", "phases"):
        assert attribute in inspect.getsource(cls.__init__), (name, attribute)


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_checks_its_own_settings(name):
    module = ENGINES[name].settings
    for function in ("prepare", "derive", "check"):
        assert callable(getattr(module, function)), (name, function)


def test_the_hf_decode_modes_share_one_declared_interface():
    assert all(issubclass(mode, DecodeMode) for mode in (Dynamic, Static, ByToken, Aligned))
    assert DecodeMode.__abstractmethods__ == {"refeed", "restep", "continue_rows", "continue_in", "generate"}
    with pytest.raises(TypeError):
        DecodeMode(None)


def test_a_prefix_kind_carries_what_it_means_for_an_engine():
    assert [k for k in PrefixKind if k.resumes] == [PrefixKind.DECODE_KV]
    assert [k for k in PrefixKind if k.retokenizes] == [PrefixKind.REFEED_TEXT]
    assert PrefixKind.REFEED_TEXT.prompt_ids((1, 2, 3), (1, 5)) == [1, 5]
    assert PrefixKind.REFEED_IDS.prompt_ids((1, 2, 3), (1, 5)) == [1, 2, 3]
    assert PrefixKind.REFEED_TEXT.prompt_ids((1, 2, 3), None) == [1, 2, 3]
    source = as_source("refeed_ids")
    assert source.kind is PrefixKind.REFEED_IDS and source.label == "refeed_ids"  # the pass tables' column
    assert PrefixSource("decode_kv", donor="refeed_ids", layers=(0, 5)).label == "decode_kv<-refeed_ids[0:5]"
    with pytest.raises(ValueError, match="must be one of"):
        PrefixSource("prefill")
