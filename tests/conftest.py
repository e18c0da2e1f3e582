"""Shared fixtures: the packaged SmolLM2 model, prepared once per test session (about a minute on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = REPO / "resources" / "packages"  # pip-downloaded wheels, shared with the workflow's cache


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct dequantized to bf16 safetensors, through the same code as the prepare_model rule."""
    from replaynoise.models import prepare_model

    out = tmp_path_factory.mktemp("models") / "smollm2-135m-bfloat16"
    prepare_model("smollm2-135m", "bfloat16", out, PACKAGES)
    return out
