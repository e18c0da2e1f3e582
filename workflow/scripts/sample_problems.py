import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.datasets import read_problems, write_problems  # noqa: E402
from replaynoise.io import write_json  # noqa: E402
from replaynoise.models import load_tokenizer, model_weights_dir  # noqa: E402
from replaynoise.rollouts import sample_fitting  # noqa: E402

p = snakemake.params
loaded = read_problems(p.source, p.path, Path(p.cache))
checks = [(c["config"], load_tokenizer(model_weights_dir(Path(c["model"]))), c["room"]) for c in p.prompt_checks]
write_problems(sample_fitting(loaded, p.n, p.seed, p.sample, checks, p.prompt, p.long_prompts),
               snakemake.output.problems)
if "read" in snakemake.output.keys():
    write_json({"path": p.path, "sha256": loaded.sha256}, snakemake.output.read)
