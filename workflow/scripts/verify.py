import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.provenance import verify_inputs, verify_manifest  # noqa: E402

problems = verify_manifest("results", snakemake.params.manifest) + verify_inputs(snakemake.params.provenance)
for line in problems:
    print(line, file=sys.stderr)
    print(line, file=sys.__stderr__)
if problems:
    raise SystemExit(f"{len(problems)} result file(s) differ from results/MANIFEST.sha256 or provenance.json: "
                     + "; ".join(problems[:10]))
print("all result files match results/MANIFEST.sha256, and every file given by path its recorded sha256",
      file=sys.__stderr__)
