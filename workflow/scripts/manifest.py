import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parents[1]))
from replaynoise.logs import log_to  # noqa: E402

log_to(snakemake.log[0])
from replaynoise.config import deviations  # noqa: E402
from replaynoise.io import read_json, write_json, write_text  # noqa: E402
from replaynoise.provenance import (  # noqa: E402
    configuration_differences,
    input_checksums,
    provenance_record,
    write_manifest,
)
from replaynoise.report.landing import landing_page  # noqa: E402
from replaynoise.vouching import sealed  # noqa: E402

n = write_manifest(list(snakemake.input), "results", snakemake.output.manifest)
write_json(
    sealed(
        provenance_record(
            snakemake.config,
            snakemake.params.analysis_hash,
            snakemake.params.repo,
            logs=Path(snakemake.log[0]).parent,
            manifest_files=n,
            inputs=input_checksums(
                snakemake.params.inputs, {r["path"]: r["sha256"] for r in map(read_json, snakemake.params.read)}
            ),
        ),
        Path(snakemake.output.manifest),
    ),
    snakemake.output.provenance,
)
write_text(
    landing_page(
        Path(snakemake.params.intro).read_text(),
        snakemake.params.headline,
        snakemake.params.conditioning,
        configuration_differences(snakemake.config),
        deviations(snakemake.config),
        snakemake.params.analysis_hash,
    ),
    snakemake.output.landing,
)
