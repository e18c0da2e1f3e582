import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
import polars as pl  # noqa: E402

from replaynoise.analysis import compare_passes, pool_credit  # noqa: E402
from replaynoise.provenance import write_json  # noqa: E402

p, a = snakemake.params, snakemake.params.analysis
files = iter(snakemake.input.credit)  # ordered config-major, pass-minor (common.smk all_credit)
credits = {c: {name: pl.read_parquet(next(files)) for name in p.passes} for c in p.configs}
result = compare_passes(pool_credit(credits), theta=a["theta"], theta_sweep=None, n_boot=a["n_boot"], seed=p.seed,
                        min_eligible=a["min_eligible"], ci=a["ci"])
result.update(config="pooled", configs=list(p.configs), analysis_hash=p.analysis_hash)
write_json(result, snakemake.output[0])
