import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.io import read_json  # noqa: E402
from replaynoise.report import controls as control_report  # noqa: E402

p, out = snakemake.params, snakemake.output
results = {c: read_json(f) for c, f in zip(p.configs, snakemake.input.comparisons)}
if "figure" in p.keys():
    getattr(control_report, f"plot_{p.figure}")(results, out.png, out.pdf)
else:
    getattr(control_report, f"write_{p.table}_table")(results, p.analysis_hash, out.csv, out.md)
