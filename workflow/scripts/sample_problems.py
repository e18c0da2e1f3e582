import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.datasets import load_problems, sample_problems, write_problems  # noqa: E402

p = snakemake.params
problems = load_problems(p.source, p.path, Path(p.cache))
write_problems(sample_problems(problems, p.n, p.seed, p.sample), snakemake.output[0])
