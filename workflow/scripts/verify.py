import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.provenance import verify_coverage, verify_inputs, verify_manifest, verify_settings  # noqa: E402
from replaynoise.vouching import record_problems, self_description_problems  # noqa: E402

p = snakemake.params
problems = (
    verify_manifest("results", p.manifest)
    + verify_coverage(p.manifest, p.expected)
    + verify_settings(p.provenance, p.config, p.analysis_hash)
    + verify_inputs(p.provenance)
    + record_problems(Path("results"), required=True)
    + self_description_problems(Path("results"))
)
for line in problems:
    print(line, file=sys.stderr)
    print(line, file=sys.__stderr__)
if problems:
    raise SystemExit(
        f"{len(problems)} problem(s) with the results, results/MANIFEST.sha256 or provenance.json: "
        + "; ".join(problems[:10])
    )
print(
    "all result files match results/MANIFEST.sha256, which lists every file the plan makes; provenance.json "
    "records this configuration; every file given by path has its recorded sha256",
    file=sys.__stderr__,
)
