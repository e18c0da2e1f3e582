rule select_pivots:
    localrule: True
    input:
        rollouts=rollouts_file("{config}"),
    output:
        pivots_file("{config}"),
    params:
        code=code_version("select_pivots"),
        pivots=config["pivots"],
        screen=config["rollouts"]["screen"],
        seed=config["seed"],
        block_size=lambda w: settings(w)["block_size"],
    log:
        f"{LOGS}/select_pivots/{{config}}.log",
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/select_pivots.py"
