rule sample_problems:
    input:
        dataset_files,
    output:
        **sampling_outputs("{dataset}"),
    log:
        f"{LOGS}/sample_problems/{{dataset}}.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    # only a listed sample has an ids param: every other run's params are as they were before the option existed
    params:
        **listed_ids(),
        code=code_version("sample_problems"),
        source=config["dataset"]["source"],
        path=config["dataset"]["path"],
        n=config["dataset"]["n_problems"],
        sample=config["dataset"]["sample"],
        seed=config["seed"],
        cache=PACKAGE_DIR,
    script:
        "../scripts/sample_problems.py"
