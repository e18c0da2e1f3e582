import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.data.preparation import prepare_model  # noqa: E402

p = snakemake.params
prepare_model(p.spec, p.dtype, Path(snakemake.output[0]), Path(p.cache))
