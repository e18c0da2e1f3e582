rule select_pivots:
    input:
        rollouts="results/rollouts/{config}/rollouts.parquet",
    output:
        "results/pivots/{config}.parquet",
    params:
        code=code_version("pivots", "seeds"),
        pivots=config["pivots"],
        seed=config["seed"],
    log:
        f"{LOGS}/select_pivots/{{config}}.log",
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/select_pivots.py"
