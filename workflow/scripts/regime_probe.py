import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.data.models import engine_context  # noqa: E402
from replaynoise.engines import make_engine  # noqa: E402
from replaynoise.generation.regime import ProbeJob, RegimeSettings, run_probe  # noqa: E402
from replaynoise.io import (  # noqa: E402
    keyed_scratch,
    read_parquet,
    remove_scratch,
    sha256_file,
    stable_hash,
    write_json,
    write_parquet,
)
from replaynoise.regime import probe_rows, probe_summary, verdict  # noqa: E402

p, s, out = snakemake.params, snakemake.params.settings, snakemake.output
key = stable_hash(
    [p.code, s, p.seed, p.prompt, p.pivots, p.rollouts, p.replay, p.size, p.topk, sha256_file(snakemake.input.problems)]
)
engine = make_engine(s, Path(snakemake.input.model), topk=p.topk, threads=snakemake.threads)
job = ProbeJob(
    config_name=snakemake.wildcards.config,
    seed=p.seed,
    settings=s,
    prompt=p.prompt,
    rollouts=p.rollouts,
    pivots=p.pivots,
    replay=p.replay,
    size=RegimeSettings(**p.size),
)
run = run_probe(
    engine,
    read_parquet(snakemake.input.problems),
    job,
    work_dir=keyed_scratch(p.work, key),
    context=engine_context(s),
)
steps, mismatch = probe_rows(run)
summary = {"config": snakemake.wildcards.config, "settings": s, "size": p.size, **probe_summary(run, steps, mismatch)}
print("\n".join(verdict(summary)), file=sys.stderr)
write_parquet(steps, out.steps)
write_parquet(mismatch, out.mismatch)
write_parquet(run.decode, out.decode)
write_json(summary, out.summary)
remove_scratch(p.work)
