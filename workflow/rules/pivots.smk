rule select_pivots:
    localrule: True
    input:
        rollouts="results/rollouts/{config}/rollouts.parquet",
    output:
        "results/pivots/{config}.parquet",
    params:
        code=code_version("pivots", "seeds"),
        pivots=config["pivots"],
        seed=config["seed"],
        align_block=lambda w: settings(w)["block_size"] if config["pivots"]["align_to_block"] else 0,
    log:
        f"{LOGS}/select_pivots/{{config}}.log",
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/select_pivots.py"
