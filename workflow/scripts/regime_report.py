import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.io import read_json, write_text  # noqa: E402
from replaynoise.regime import verdict  # noqa: E402

parts = ["# Regime probe", ""]
for config_name, path in zip(snakemake.params.configs, snakemake.input):
    parts += [f"## {config_name}", "", *verdict(read_json(path)), ""]
text = "\n".join(parts)
print(text, file=sys.stderr)
write_text(text, snakemake.output[0])
