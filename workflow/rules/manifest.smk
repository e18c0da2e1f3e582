def manifest_inputs(wildcards=None):
    """Every output of the DAG, so the manifest covers exactly this configuration's results."""
    files = [problems_file()]
    files += sorted({f"results/models/{model_key(c)}" for c in CONFIGS})
    for c in CONFIGS:
        files += [f"results/rollouts/{c}/rollouts.parquet", f"results/rollouts/{c}/kv", f"results/pivots/{c}.parquet"]
        files += [pass_file(c, p) for p in RUN_PASSES] + [credit_file(c, p) for p in RUN_PASSES]
        files += [f"results/analysis/{c}/comparison.json", f"results/analysis/{c}/channels.csv"]
    files += ["results/analysis/pooled/comparison.json"]
    files += [f"results/tables/headline.{ext}" for ext in ("csv", "md", "tex")]
    files += rules.figures.input
    return files


rule manifest:
    input:
        manifest_inputs,
    output:
        manifest="results/MANIFEST.sha256",
        provenance="results/provenance.json",
    params:
        config=config,
        analysis_hash=ANALYSIS_HASH,
        repo=workflow.basedir,
    log:
        f"{LOGS}/manifest.log",
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/manifest.py"


# Checks the results as they are on disk, so it has no inputs: Snakemake must not rebuild anything first.
rule verify:
    params:
        manifest="results/MANIFEST.sha256",
    log:
        f"{LOGS}/verify.log",
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/verify.py"


rule rollouts_only:
    input:
        expand("results/pivots/{config}.parquet", config=CONFIGS),


rule passes_only:
    input:
        [pass_file(c, p) for c in CONFIGS for p in RUN_PASSES],
