"""Which configurations a pooled comparison may put together: light enough for the workflow's parse (no
statistics library), below both the pooling (``analysis.pooling``) and the plan of outputs (``plan``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replaynoise.io import stable_hash

#: The settings a pooled comparison keeps apart: configurations pool only where these are equal. A floor and a
#: re-feed rate belong to one engine, one kernel mode and one model as trained and stored (a GRPO-trained model is
#: another model than its base, fp16 another than bf16): pooled across them, they describe none of the runs, and a
#: problem shared by two models would count as two independent clusters.
POOL_KEYS = ("engine", "kernels", "model", "dtype", "train")


def pool_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A configuration's ``POOL_KEYS`` values; its train block by the hash of its recipe ("untrained" without one)."""
    train = settings.get("train")
    return {
        **{key: settings.get(key) for key in POOL_KEYS},
        "train": "untrained" if train is None else f"grpo-{stable_hash(train)[:8]}",
    }
