import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.data.models import engine_context  # noqa: E402
from replaynoise.engines import make_engine  # noqa: E402
from replaynoise.generation import replay  # noqa: E402
from replaynoise.generation.shards import shard_index  # noqa: E402
from replaynoise.io import (  # noqa: E402
    keyed_scratch,
    read_json,
    read_parquet,
    remove_scratch,
    sha256_file,
    stable_hash,
    write_parquet,
)
from replaynoise.settings import ReplaySettings  # noqa: E402

p, s, r = snakemake.params, snakemake.params.settings, snakemake.params.replay
engine = make_engine(s, Path(snakemake.input.model), topk=p.topk, threads=snakemake.threads)
inputs = [sha256_file(f) for f in (snakemake.input.pivots, snakemake.input.rollouts, snakemake.input.kv)]
job = replay.PassJob(
    pass_name=p.pass_name,
    config_name=snakemake.wildcards.config,
    seed=p.seed,
    sampling=replay.continuation_sampling(s, r),
    replay=ReplaySettings.of(r),
)
frame = replay.run_pass(
    engine,
    read_parquet(snakemake.input.pivots),
    read_parquet(snakemake.input.rollouts),
    job,
    work_dir=keyed_scratch(p.work, stable_hash([p.code, s, p.seed, r, p.topk, p.n_shards, inputs])),
    shard=(shard_index(snakemake.wildcards.shard), p.n_shards),
    kv_dirs=[Path(d) for d in read_json(snakemake.input.kv)["folders"]],
    context=engine_context(s),
)
write_parquet(frame, snakemake.output[0])
remove_scratch(p.work)
