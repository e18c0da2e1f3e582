"""replaynoise: does the way a rollout's prefix is replayed change token-level credit estimates?

Importing the package turns the Hugging Face libraries offline before any of them can be imported:
huggingface_hub reads these variables once, at its own import, so setting them later would be too late.
Models and data come only from pinned packages or local paths; no step ever asks a hub.
"""

import os as _os

for _flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    _os.environ.setdefault(_flag, "1")
