import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise import rollouts  # noqa: E402
from replaynoise.engines import make_engine  # noqa: E402
from replaynoise.engines.base import SamplingSettings  # noqa: E402
from replaynoise.io import read_parquet, remove_scratch, sha256_file, stable_hash, write_parquet  # noqa: E402
from replaynoise.models import engine_context  # noqa: E402
from replaynoise.pivots import PivotRules  # noqa: E402
from replaynoise.settings import PromptSettings, long_prompts  # noqa: E402
from replaynoise.shards import problem_range, shard_index  # noqa: E402

p, s = snakemake.params, snakemake.params.settings
prompt = PromptSettings.of(p.prompt)
engine = make_engine(s, Path(snakemake.input.model), topk=p.topk, threads=snakemake.threads)
problems = read_parquet(snakemake.input.problems)
mine = problem_range(shard_index(snakemake.wildcards.shard), p.shard_size, problems.height)
shard = problems[mine.start:mine.stop]
frame = rollouts.generate(
    engine, problems, mine=mine, config_name=snakemake.wildcards.config, seed=p.seed,
    sampling=SamplingSettings(s["temperature"], s["top_p"], s["max_new_tokens"]), style=prompt.style,
    instruction=prompt.instruction, shots=prompt.shots,
    rules=PivotRules.from_config(p.pivots, s["block_size"]),
    per_problem=p.rollouts["per_problem"], batch_size=p.rollouts["batch_size"], kv_dir=Path(snakemake.output.kv),
    context=engine_context(s), long_prompts=long_prompts(p.rollouts), dataset=p.dataset,
    work_dir=Path(p.work), scratch_key=stable_hash([p.code, s, p.seed, p.prompt, p.pivots, p.rollouts, p.topk,
                                                    sha256_file(snakemake.input.problems),
                                                    shard["problem_id"].to_list()]))
write_parquet(frame, snakemake.output.rollouts)
remove_scratch(p.work)
