import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.io import read_json  # noqa: E402
from replaynoise.report.mechanism import plot_mechanism, write_table  # noqa: E402

p, out = snakemake.params, snakemake.output
summaries = {c: read_json(f) for c, f in zip(p.configs, snakemake.input)}
plot_mechanism(summaries, out.png, out.pdf)
write_table(summaries, Path(out.csv), Path(out.md), heading="# Re-feed mechanism by prefix length")
