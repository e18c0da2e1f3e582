import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.provenance import verify_manifest  # noqa: E402

problems = verify_manifest("results", snakemake.params.manifest)
for line in problems:
    print(line, file=sys.stderr)
    print(line, file=sys.__stderr__)
if problems:
    raise SystemExit(f"{len(problems)} result file(s) differ from results/MANIFEST.sha256: " + "; ".join(problems[:10]))
print("all result files match results/MANIFEST.sha256", file=sys.__stderr__)
