rule manifest:
    localrule: True
    input:
        manifest_inputs,
    output:
        manifest=MANIFEST,
        provenance=PROVENANCE,
    params:
        code=code_version("manifest"),
        config=config,
        analysis_hash=ANALYSIS_HASH,
        repo=workflow.basedir,
        inputs=user_inputs(),
        read=[dataset_read_file()] if config["dataset"]["source"] == "file" else [],
    log:
        f"{LOGS}/manifest.log",
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/manifest.py"


# Checks the results as they are on disk, so it has no inputs: Snakemake must not rebuild anything first.
rule verify:
    localrule: True
    params:
        manifest=MANIFEST,
        provenance=PROVENANCE,
    log:
        f"{LOGS}/verify.log",
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/verify.py"


rule rollouts_only:
    localrule: True
    input:
        [pivots_file(c) for c in CONFIGS],


rule passes_only:
    localrule: True
    input:
        [pass_file(c, p) for c in CONFIGS for p in RUN_PASSES],
