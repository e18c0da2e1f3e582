import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.analysis.credit import compute_credit  # noqa: E402
from replaynoise.io import read_parquet, write_parquet  # noqa: E402

credit = compute_credit(
    read_parquet(snakemake.input.passes),
    read_parquet(snakemake.input.pivots),
    snakemake.params.k,
    snakemake.wildcards.pass_name,
    eligibility=snakemake.params.eligibility,
)
write_parquet(credit, snakemake.output[0])
