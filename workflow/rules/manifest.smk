rule manifest:
    input:
        manifest_inputs,
    output:
        manifest=MANIFEST,
        provenance=PROVENANCE,
        landing=LANDING,
    log:
        f"{LOGS}/manifest.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("manifest"),
        # what the record's numbers depend on: a change of resources, prices or the regime probe's size moves no
        # result, so it reruns no manifest (provenance.json records the configuration of the run that wrote it)
        settings={key: value for key, value in config.items() if key not in ("resources", "cost", "regime")},
        analysis_hash=ANALYSIS_HASH,
        repo=workflow.basedir,
        inputs=user_inputs(),
        read=[dataset_read_file()] if config["dataset"]["source"] == "file" else [],
        headline=table_file("headline", "csv"),
        conditioning=config["figures"]["conditioning"],
        intro=f"{workflow.basedir}/{STATIC_LANDING}",
    script:
        "../scripts/manifest.py"


# Checks the results as they are on disk, so it has no inputs: Snakemake must not rebuild anything first. Its log
# is Snakemake's own folder's, beside the working directory's other run records: a reviewer's check runs on a
# read-only copy of results/ and writes nothing into it.
rule verify:
    log:
        ".snakemake/log/verify.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        manifest=MANIFEST,
        provenance=PROVENANCE,
        # the files this configuration's plan makes (a folder's files are listed when it is written)
        expected=lambda w: manifest_expected_files(),
        config=config,
        analysis_hash=ANALYSIS_HASH,
    script:
        "../scripts/verify.py"


rule rollouts_only:
    input:
        [pivots_file(c) for c in CONFIGS],
    localrule: True


rule passes_only:
    input:
        [pass_file(c, p) for c in CONFIGS for p in RUN_PASSES],
    localrule: True
