import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.report.cost import TimedJob, write_report  # noqa: E402

p = snakemake.params
table = write_report(
    [TimedJob(**job) for job in p.jobs],
    snakemake.output.csv,
    snakemake.output.md,
    gpu_hour=p.prices["gpu_hour"],
    cpu_core_hour=p.prices["cpu_core_hour"],
    currency=p.prices["currency"],
)
print(table)
