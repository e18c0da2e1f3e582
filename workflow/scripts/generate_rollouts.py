import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise import rollouts  # noqa: E402
from replaynoise.engines import make_engine  # noqa: E402
from replaynoise.engines.base import SamplingSettings  # noqa: E402
from replaynoise.provenance import read_parquet, remove_scratch, write_parquet  # noqa: E402
from replaynoise.shards import problem_range, shard_index  # noqa: E402

p, s = snakemake.params, snakemake.params.settings
engine = make_engine(s, Path(snakemake.input.model), topk=p.topk, threads=snakemake.threads)
problems = read_parquet(snakemake.input.problems)
mine = problem_range(shard_index(snakemake.wildcards.shard), p.shard_size, problems.height)
frame = rollouts.generate(
    engine, problems[mine.start:mine.stop], config_name=snakemake.wildcards.config, seed=p.seed,
    sampling=SamplingSettings(s["temperature"], s["top_p"], s["max_new_tokens"]), style=p.prompt["style"],
    instruction=p.prompt["instruction"], max_margin=p.max_margin, kv_dir=Path(snakemake.output.kv),
    work_dir=Path(p.work))
write_parquet(frame, snakemake.output.rollouts)
remove_scratch(p.work)
