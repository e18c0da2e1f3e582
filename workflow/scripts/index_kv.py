import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.generation.continuations import kv_index  # noqa: E402
from replaynoise.io import write_json  # noqa: E402

write_json(kv_index([Path(d) for d in snakemake.input]), snakemake.output[0])
