import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.analysis.cross_scoring import cross_mismatch  # noqa: E402
from replaynoise.engines import make_engine  # noqa: E402
from replaynoise.engines.base import SamplingSettings  # noqa: E402
from replaynoise.io import read_parquet, write_json, write_parquet  # noqa: E402

p, s = snakemake.params, snakemake.params.settings
engine = make_engine(s, Path(snakemake.input.model), topk=p.topk, threads=snakemake.threads)
rows, summary = cross_mismatch(
    engine,
    read_parquet(snakemake.input.rollouts),
    read_parquet(snakemake.input.pivots),
    rollouts_config=snakemake.wildcards.rollouts,
    scorer_config=snakemake.wildcards.config,
    seed=p.seed,
    sampling=SamplingSettings(s["temperature"], s["top_p"], s["max_new_tokens"]),
    batch_size=p.batch_size,
)
print(rows.drop("decode_logprobs", "refeed_logprobs"), file=sys.stderr)
write_parquet(rows, snakemake.output.rows)
write_json(summary, snakemake.output.summary)
