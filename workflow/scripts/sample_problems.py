import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.data.datasets import read_problems, sample_problems, write_problems  # noqa: E402
from replaynoise.io import write_json  # noqa: E402

p = snakemake.params
loaded = read_problems(p.source, p.path, Path(p.cache))
write_problems(sample_problems(loaded.frame, p.n, p.seed, p.sample, p.get("ids")), snakemake.output.problems)
if "read" in snakemake.output.keys():
    write_json({"path": p.path, "sha256": loaded.sha256}, snakemake.output.read)
