import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.data.models import engine_context  # noqa: E402
from replaynoise.engines import make_engine  # noqa: E402
from replaynoise.engines.base import SamplingSettings  # noqa: E402
from replaynoise.generation import rollouts  # noqa: E402
from replaynoise.generation.pivots import PivotRules  # noqa: E402
from replaynoise.generation.shards import problem_range, shard_index  # noqa: E402
from replaynoise.io import keyed_scratch, read_parquet, remove_scratch, sha256_file, stable_hash, write_parquet  # noqa: E402
from replaynoise.settings import PromptSettings, RolloutSettings  # noqa: E402

p, s = snakemake.params, snakemake.params.settings
engine = make_engine(s, Path(snakemake.input.model), topk=p.topk, threads=snakemake.threads)
problems = read_parquet(snakemake.input.problems)
mine = problem_range(shard_index(snakemake.wildcards.shard), p.shard_size, problems.height)
job = rollouts.RolloutJob(
    config_name=snakemake.wildcards.config,
    seed=p.seed,
    sampling=SamplingSettings(s["temperature"], s["top_p"], s["max_new_tokens"]),
    prompt=PromptSettings.of(p.prompt),
    rollouts=RolloutSettings.of(p.rollouts),
    rules=PivotRules.from_config(p.pivots, s["block_size"]),
)
key = stable_hash(
    [
        p.code,
        s,
        p.seed,
        p.prompt,
        p.pivots,
        p.rollouts,
        p.topk,
        sha256_file(snakemake.input.problems),
        problems[mine.start : mine.stop]["problem_id"].to_list(),
    ]
)
frame = rollouts.generate(
    engine,
    problems,
    job,
    mine=mine,
    kv_dir=Path(snakemake.output.kv),
    work_dir=keyed_scratch(p.work, key),
    context=engine_context(s),
    dataset=p.dataset,
)
write_parquet(frame, snakemake.output.rollouts)
remove_scratch(p.work)
