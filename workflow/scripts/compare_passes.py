import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.analysis.channels import assert_all_identical, channel_agreement  # noqa: E402
from replaynoise.analysis.comparison import cache_summary, compare_passes  # noqa: E402
from replaynoise.analysis.controls import control_summary  # noqa: E402
from replaynoise.analysis.prefix_mismatch import mismatch_summary  # noqa: E402
from replaynoise.analysis.probes import probe_deltas  # noqa: E402
from replaynoise.analysis.verification import check_verified, verification_summary  # noqa: E402
from replaynoise.io import read_parquet, write_json, write_text  # noqa: E402
from replaynoise.settings import AnalysisSettings  # noqa: E402

p = snakemake.params
credit = {name: read_parquet(f) for name, f in zip(p.passes, snakemake.input.credit)}
passes = {name: read_parquet(f) for name, f in zip(p.passes, snakemake.input.passes)}
s = AnalysisSettings.of(p.analysis, p.seed)
verification = verification_summary(credit["exact"], passes.get("refeed"), passes["exact"])
check_verified(verification, s.min_verified)
result = compare_passes(credit, s, probes=probe_deltas(passes))
result.update(
    config=snakemake.wildcards.config,
    kernels=p.kernels,
    analysis_hash=p.analysis_hash,
    verification=verification,
    prefix_cache=cache_summary(passes),
    controls=control_summary(passes, credit, metric=s.metric, n_boot=s.n_boot, seed=s.seed, ci=s.ci),
)
result["prefix_mismatch"] = mismatch_summary(
    read_parquet(snakemake.input.mismatch),
    credit,
    result,
    config=snakemake.wildcards.config,
    metric=s.metric,
    min_eligible=s.min_eligible,
    ci=s.ci,
)
channels = channel_agreement(passes, credit)
print(channels, file=sys.stderr)
if p.kernels == "invariant":
    assert_all_identical(channels)  # batch-invariant execution: any difference is a bug, so the step fails
write_json(result, snakemake.output.comparison)
write_text(channels.write_csv(), snakemake.output.channels)
