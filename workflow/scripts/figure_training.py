import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.report.training import plot_training  # noqa: E402

plot_training(dict(zip(snakemake.params.models, snakemake.input.logs)), snakemake.output.png, snakemake.output.pdf)
