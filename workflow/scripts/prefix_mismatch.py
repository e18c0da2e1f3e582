import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.analysis.prefix_mismatch import mismatch_rows  # noqa: E402
from replaynoise.io import read_parquet, write_parquet  # noqa: E402

p = snakemake.params
passes = {name: read_parquet(f) for name, f in zip(p.passes, snakemake.input.passes)}
rows = mismatch_rows(read_parquet(snakemake.input.rollouts), read_parquet(snakemake.input.pivots), passes)
print(rows.drop("decode_logprobs", "refeed_logprobs"), file=sys.stderr)
write_parquet(rows, snakemake.output[0])
