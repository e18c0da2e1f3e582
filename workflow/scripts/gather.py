import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.generation import replay, rollouts  # noqa: E402
from replaynoise.io import read_parquet, write_parquet  # noqa: E402

gather = {"gather_rollouts": rollouts.gather, "gather_pass": replay.gather}[snakemake.rule]
write_parquet(gather([read_parquet(f) for f in snakemake.input]), snakemake.output[0])
