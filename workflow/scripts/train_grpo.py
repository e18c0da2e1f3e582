import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.io import read_json, read_parquet, remove_scratch, sha256_file, stable_hash  # noqa: E402
from replaynoise.training import train_grpo  # noqa: E402

p, r = snakemake.params, snakemake.params.recipe
train_grpo(Path(snakemake.input.base), Path(snakemake.output.model), Path(p.work), train=r["train"],
           prompt=r["prompt"], stops=r["stop"], dtype=p.dtype, device=r["device"],
           threads=r.get("cpu_threads", snakemake.threads),
           problems=read_parquet(snakemake.input.problems), log_csv=Path(snakemake.output.log),
           # the base model's own record (its weights' digests) too: checkpoints of other weights are never resumed
           scratch_key=stable_hash([p.code, r, p.dtype, sha256_file(snakemake.input.problems),
                                    read_json(Path(snakemake.input.base) / "replaynoise-model.json")]))
remove_scratch(p.work)
