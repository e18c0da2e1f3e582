rule select_pivots:
    input:
        rollouts=rollouts_file("{config}"),
    output:
        pivots_file("{config}"),
    log:
        f"{LOGS}/select_pivots/{{config}}.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("select_pivots"),
        pivots=config["pivots"],
        screen=config["rollouts"]["screen"],
        seed=config["seed"],
        block_size=lambda w: settings(w)["block_size"],
    script:
        "../scripts/select_pivots.py"
