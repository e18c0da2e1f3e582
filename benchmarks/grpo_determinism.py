"""Does GRPO training reproduce its weights? Retrain a trained model of a finished run from its own record (same
base, recipe and seed) and compare the weights: sha256 per file, and the largest difference per tensor where
they differ. Run where the model was trained (the GPU for a GPU run):
    python benchmarks/grpo_determinism.py RUN_DIR MODEL_KEY OUT_JSON
"""

import json
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

from replaynoise.data.datasets import training_set
from replaynoise.generation.training import train_grpo
from replaynoise.io import read_json, read_parquet

run, key, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
results = run / "results"
record = read_json(results / "models" / key / "replaynoise-model.json")
origin = record["origin"]
base = results / "models" / key.rsplit("-grpo-", 1)[0]  # a trained model's key extends its base's
problems_file = results / "training" / key / "problems.parquet"
if problems_file.is_file():
    problems = read_parquet(problems_file)
else:  # a run made before the training problems were a step's output: chosen again as that run chose them
    excluded = []
    if origin["train"]["dataset"] == read_json(results / "provenance.json")["config"]["dataset"]["source"]:
        excluded = read_parquet(next((results / "problems").glob("*.parquet")))["question"].to_list()
    problems = training_set(
        origin["train"]["dataset"], run / "resources" / "packages", excluded, origin["train"]["prompts_per_step"]
    )
tmp = Path(tempfile.mkdtemp())
start = time.time()
recipe = {
    "train": origin["train"],
    "prompt": origin["prompt"],
    "stop": origin.get("stop", []),
    "device": origin.get("device", "cuda"),
}
info = train_grpo(
    base,
    tmp / "again",
    tmp / "work",
    recipe,
    dtype=record["dtype"],
    threads=4,
    problems=problems,
    log_csv=tmp / "log.csv",
)
seconds = time.time() - start
diffs = {}
for name in origin["weights_sha256"]:
    a, b = load_file(results / "models" / key / name), load_file(tmp / "again" / name)
    diffs.update({t: float((a[t].float() - b[t].float()).abs().max()) for t in a if not a[t].equal(b[t])})
result = {
    "model": key,
    "recorded": origin["weights_sha256"],
    "retrained": info["origin"]["weights_sha256"],
    "identical": origin["weights_sha256"] == info["origin"]["weights_sha256"],
    "seconds": round(seconds, 1),
    "tensors_differing": len(diffs),
    "max_abs_difference": max(diffs.values(), default=0.0),
    "versions": info["origin"]["versions"],
}
out.write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps(result, indent=1))
