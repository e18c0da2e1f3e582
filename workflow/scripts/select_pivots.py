import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.pivots import select_pivots  # noqa: E402
from replaynoise.provenance import read_parquet, write_parquet  # noqa: E402

cfg = snakemake.params.pivots
pivots = select_pivots(read_parquet(snakemake.input.rollouts), max_margin=cfg["max_margin"],
                       per_rollout=cfg["per_rollout"], choose=cfg["choose"], seed=snakemake.params.seed,
                       config_name=snakemake.wildcards.config, align_block=snakemake.params.align_block)
write_parquet(pivots, snakemake.output[0])
