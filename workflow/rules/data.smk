rule sample_problems:
    localrule: True
    input:
        dataset_files,
    output:
        **sampling_outputs("{dataset}"),
    params:
        code=code_version("sample_problems"),
        source=config["dataset"]["source"],
        path=config["dataset"]["path"],
        n=config["dataset"]["n_problems"],
        sample=config["dataset"]["sample"],
        seed=config["seed"],
        cache=PACKAGE_DIR,
    log:
        f"{LOGS}/sample_problems/{{dataset}}.log",
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/sample_problems.py"
