import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.analysis.credit import read_credit_grid  # noqa: E402
from replaynoise.analysis.pooling import pooled_comparison  # noqa: E402
from replaynoise.io import write_json  # noqa: E402
from replaynoise.settings import AnalysisSettings  # noqa: E402

p = snakemake.params
credits = read_credit_grid(list(snakemake.input.credit), p.configs, p.passes)
pooled = pooled_comparison(credits, p.settings, AnalysisSettings.of(p.analysis, p.seed), p.analysis_hash)
write_json(pooled, snakemake.output[0])
