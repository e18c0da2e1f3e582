import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.generation.training import train_grpo  # noqa: E402
from replaynoise.io import keyed_scratch, read_json, read_parquet, remove_scratch, sha256_file, stable_hash  # noqa: E402

p, r = snakemake.params, snakemake.params.recipe
# the base model's own record (its weights' digests) in the key too: checkpoints of other weights are never resumed
key = stable_hash(
    [
        p.code,
        r,
        p.dtype,
        sha256_file(snakemake.input.problems),
        read_json(Path(snakemake.input.base) / "replaynoise-model.json"),
    ]
)
train_grpo(
    Path(snakemake.input.base),
    Path(snakemake.output.model),
    keyed_scratch(p.work, key),
    r,
    dtype=p.dtype,
    threads=r.get("cpu_threads", snakemake.threads),
    problems=read_parquet(snakemake.input.problems),
    log_csv=Path(snakemake.output.log),
)
remove_scratch(p.work)
