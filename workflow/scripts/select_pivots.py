import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.generation.pivots import PivotRules, screened_problems, select_pivots  # noqa: E402
from replaynoise.io import read_parquet, write_parquet  # noqa: E402

p = snakemake.params
rollouts = read_parquet(snakemake.input.rollouts)
kept = screened_problems(rollouts, p.screen["rule"], p.screen["fixed"], p.screen["keep"], p.screen["skip"])
print(
    f"screen {p.screen['rule']}: {len(kept)} of {rollouts['problem_id'].n_unique()} problems give pivots",
    file=sys.stderr,
)
pivots = select_pivots(
    rollouts,
    PivotRules.from_config(p.pivots, p.block_size),
    seed=p.seed,
    config_name=snakemake.wildcards.config,
    problems=kept,
)
print(f"{pivots.height} pivots from {pivots.select('problem_id', 'rollout').n_unique()} rollouts", file=sys.stderr)
write_parquet(pivots, snakemake.output[0])
