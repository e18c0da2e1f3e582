import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.io import read_json  # noqa: E402
from replaynoise.report.headline import headline_rows  # noqa: E402
from replaynoise.report.tables import mismatch_lines, write_headline_tables  # noqa: E402

results = {c: read_json(f) for c, f in zip(snakemake.params.configs, snakemake.input.configs)}
results["pooled"] = read_json(snakemake.input.pooled)
out = snakemake.output
write_headline_tables(
    headline_rows(results), snakemake.params.analysis_hash, out.csv, out.md, out.tex, mismatch_lines(results)
)
