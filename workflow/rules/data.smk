rule sample_problems:
    localrule: True
    input:
        dataset_files,
        models=[model_path(key) for key in sorted(MODEL_KEYS)],
    output:
        **sampling_outputs("{dataset}"),
    params:
        code=code_version("sample_problems"),
        source=config["dataset"]["source"],
        path=config["dataset"]["path"],
        n=config["dataset"]["n_problems"],
        sample=config["dataset"]["sample"],
        long_prompts=config["dataset"].get("long_prompts", "refuse"),
        seed=config["seed"],
        prompt=config["prompt"],
        prompt_checks=[dict(config=c, model=model_path(model_key(c)), room=prompt_room(config, c)) for c in CONFIGS],
        cache=PACKAGE_DIR,
    log:
        f"{LOGS}/sample_problems/{{dataset}}.log",
    conda:
        "../../envs/torch.yaml"
    script:
        "../scripts/sample_problems.py"
