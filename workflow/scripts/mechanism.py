import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.analysis.agreement import first_steps  # noqa: E402
from replaynoise.analysis.mechanism import mechanism_summary  # noqa: E402
from replaynoise.io import read_parquet, write_json, write_parquet  # noqa: E402
from replaynoise.settings import AnalysisSettings  # noqa: E402

p, out = snakemake.params, snakemake.output
credit = {n: read_parquet(f) for n, f in zip(p.passes, snakemake.input.credit)}
steps = first_steps({n: read_parquet(f) for n, f in zip(p.passes, snakemake.input.passes)})
s = AnalysisSettings.of(p.analysis, p.seed)
summary = mechanism_summary(
    credit, steps, read_parquet(snakemake.input.mismatch), metric=s.metric, ci=s.ci, n_boot=s.n_boot, seed=s.seed
)
write_parquet(steps, out.steps)
write_json({"config": snakemake.wildcards.config, **summary}, out.summary)
