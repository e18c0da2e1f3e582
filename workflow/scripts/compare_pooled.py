import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.analysis import POOLED_PROBE_REASON, compare_passes, comparison_settings, pool_credit  # noqa: E402
from replaynoise.credit import read_credit_grid  # noqa: E402
from replaynoise.io import write_json  # noqa: E402

p = snakemake.params
credits = read_credit_grid(list(snakemake.input.credit), p.configs, p.passes)
result = compare_passes(pool_credit(credits), **comparison_settings(p.analysis, p.seed),
                        probe_reason=POOLED_PROBE_REASON)
result.update(config="pooled", configs=list(p.configs), analysis_hash=p.analysis_hash)
write_json(result, snakemake.output[0])
