rule generate_rollouts:
    input:
        problems=problems_file(),
        model=model_dir,
    output:
        rollouts="results/rollouts/{config}/rollouts.parquet",
        kv=directory("results/rollouts/{config}/kv"),
    params:
        code=code_version("rollouts", "engines", "pivots", "data", "seeds", "models", "provenance"),
        settings=settings,
        seed=config["seed"],
        prompt=config["prompt"],
        max_margin=config["pivots"]["max_margin"],
        topk=config["pivots"]["topk"],
        work="results/work/{config}/rollouts",
    log:
        f"{LOGS}/generate_rollouts/{{config}}.log",
    benchmark:
        f"{BENCH}/generate_rollouts/{{config}}.tsv"
    threads: config["resources"]["threads"]
    resources:
        gpu=lambda w: int(settings(w)["device"].startswith("cuda")),
    conda:
        "../../envs/torch.yaml"
    script:
        "../scripts/generate_rollouts.py"
