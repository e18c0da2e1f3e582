import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.data.datasets import training_set  # noqa: E402
from replaynoise.io import read_parquet, write_parquet  # noqa: E402

p = snakemake.params
excluded = read_parquet(snakemake.input.excluded[0])["question"].to_list() if snakemake.input.excluded else []
write_parquet(training_set(p.dataset, Path(p.cache), excluded, p.per_step), snakemake.output[0])
