import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
import polars as pl  # noqa: E402

from replaynoise.analysis.credit import read_credit_grid  # noqa: E402
from replaynoise.io import read_json  # noqa: E402
from replaynoise.report.plots import PLOTS  # noqa: E402

p, out = snakemake.params, snakemake.output
plot = PLOTS[p.figure]
if "channels" in snakemake.input.keys():
    data = {
        c: (read_json(f), pl.read_csv(t))
        for c, f, t in zip(p.configs, snakemake.input.comparisons, snakemake.input.channels)
    }
elif "comparisons" in snakemake.input.keys():
    data = {c: read_json(f) for c, f in zip(p.configs, snakemake.input.comparisons)}
else:
    data = read_credit_grid(list(snakemake.input.credit), p.configs, p.passes)
plot(data, out.png, out.pdf, **p.options)
