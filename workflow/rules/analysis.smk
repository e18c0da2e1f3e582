rule prefix_mismatch:
    input:
        rollouts=rollouts_file("{config}"),
        pivots=pivots_file("{config}"),
        passes=lambda w: [pass_file(w.config, p) for p in RUN_PASSES],
    output:
        mismatch_file("{config}"),
    log:
        f"{LOGS}/prefix_mismatch/{{config}}.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("prefix_mismatch"),
        passes=RUN_PASSES,
    script:
        "../scripts/prefix_mismatch.py"


# One configuration's rollouts scored by another's model and engine (analysis.cross_scoring): a model job of the
# scorer, {config}, on the pivots of {rollouts}.
rule cross_score:
    input:
        model=model_dir,
        rollouts=lambda w: rollouts_file(w.rollouts),
        pivots=lambda w: pivots_file(w.rollouts),
    output:
        rows=cross_file("{rollouts}", "{config}", "parquet"),
        summary=cross_file("{rollouts}", "{config}", "json"),
    log:
        f"{LOGS}/cross_score/{{rollouts}}.{{config}}.log",
    benchmark:
        benchmark_file("cross_score", "{rollouts}.{config}")
    conda:
        engine_env
    threads: heavy("replay", "threads")
    resources:
        mem_mb=heavy("replay", "mem_mb"),
        runtime=heavy("replay", "runtime"),
        gpu=gpus,
        gpu_gib=gpu_gib,
    params:
        code=code_version("cross_score"),
        settings=pass_settings,
        seed=config["seed"],
        batch_size=config["replay"]["batch_size"],
        topk=config["pivots"]["topk"],
    script:
        "../scripts/cross_score.py"


rule compare_passes:
    input:
        credit=lambda w: [credit_file(w.config, p) for p in RUN_PASSES],
        passes=lambda w: [pass_file(w.config, p) for p in RUN_PASSES],
        mismatch=mismatch_file("{config}"),
    output:
        comparison=comparison_file("{config}"),
        channels=report(
            channels_file("{config}"),
            caption="../report/channels.rst",
            category="Tables",
            subcategory="{config}",
        ),
    log:
        f"{LOGS}/compare_passes/{{config}}.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("compare_passes"),
        passes=RUN_PASSES,
        analysis=config["analysis"],
        seed=config["seed"],
        kernels=lambda w: settings(w)["kernels"],
        analysis_hash=ANALYSIS_HASH,
    script:
        "../scripts/compare_passes.py"


rule mechanism:
    input:
        credit=lambda w: [credit_file(w.config, p) for p in MECHANISM_PASSES],
        passes=lambda w: [pass_file(w.config, p) for p in MECHANISM_PASSES],
        mismatch=mismatch_file("{config}"),
    output:
        steps=first_steps_file("{config}"),
        summary=mechanism_file("{config}"),
    log:
        f"{LOGS}/mechanism/{{config}}.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("mechanism"),
        passes=MECHANISM_PASSES,
        analysis=config["analysis"],
        seed=config["seed"],
    script:
        "../scripts/mechanism.py"


rule compare_pooled:
    input:
        credit=all_credit,
    output:
        comparison_file("pooled"),
    log:
        f"{LOGS}/compare_pooled.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("compare_pooled"),
        analysis=config["analysis"],
        seed=config["seed"],
        configs=CONFIGS,
        settings={c: pool_settings(config["configs"][c]) for c in CONFIGS},
        passes=RUN_PASSES,
        analysis_hash=ANALYSIS_HASH,
    script:
        "../scripts/compare_pooled.py"


rule headline_tables:
    input:
        configs=all_comparisons,
        pooled=comparison_file("pooled"),
    output:
        csv=report(table_file("headline", "csv"), caption="../report/headline.rst", category="Tables"),
        md=table_file("headline", "md"),
        tex=table_file("headline", "tex"),
    log:
        f"{LOGS}/headline_tables.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("headline_tables"),
        configs=CONFIGS,
        analysis_hash=ANALYSIS_HASH,
    script:
        "../scripts/headline_tables.py"
