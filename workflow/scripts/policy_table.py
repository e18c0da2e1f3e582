import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.io import read_parquet  # noqa: E402
from replaynoise.report.training import policy_table, write_policy_tables  # noqa: E402

p = snakemake.params
rollouts = {c: read_parquet(f) for c, f in zip(p.configs, snakemake.input.rollouts)}
write_policy_tables(policy_table(rollouts, p.models, p.ci), p.ci, snakemake.output.csv, snakemake.output.md)
