rule compare_passes:
    localrule: True
    input:
        credit=lambda w: [credit_file(w.config, p) for p in RUN_PASSES],
        passes=lambda w: [pass_file(w.config, p) for p in RUN_PASSES],
    output:
        comparison="results/analysis/{config}/comparison.json",
        channels=report(
            "results/analysis/{config}/channels.csv",
            caption="../report/channels.rst",
            category="Tables",
            subcategory="{config}",
        ),
    params:
        code=code_version("compare_passes"),
        passes=RUN_PASSES,
        analysis=config["analysis"],
        seed=config["seed"],
        kernels=lambda w: settings(w)["kernels"],
        analysis_hash=ANALYSIS_HASH,
    log:
        f"{LOGS}/compare_passes/{{config}}.log",
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/compare_passes.py"


rule compare_pooled:
    localrule: True
    input:
        credit=all_credit,
    output:
        "results/analysis/pooled/comparison.json",
    params:
        code=code_version("compare_pooled"),
        analysis=config["analysis"],
        seed=config["seed"],
        configs=CONFIGS,
        passes=RUN_PASSES,
        analysis_hash=ANALYSIS_HASH,
    log:
        f"{LOGS}/compare_pooled.log",
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/compare_pooled.py"


rule headline_tables:
    localrule: True
    input:
        configs=expand("results/analysis/{config}/comparison.json", config=CONFIGS),
        pooled="results/analysis/pooled/comparison.json",
    output:
        csv=report("results/tables/headline.csv", caption="../report/headline.rst", category="Tables"),
        md="results/tables/headline.md",
        tex="results/tables/headline.tex",
    params:
        code=code_version("headline_tables"),
        configs=CONFIGS,
        analysis_hash=ANALYSIS_HASH,
    log:
        f"{LOGS}/headline_tables.log",
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/headline_tables.py"
