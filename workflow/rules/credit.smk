rule compute_credit:
    localrule: True
    input:
        passes=lambda w: pass_file(w.config, w.pass_name),
        pivots="results/pivots/{config}.parquet",
    output:
        "results/credit/{config}/{pass_name}.parquet",
    params:
        code=code_version("compute_credit"),
        k=config["replay"]["k"],
        eligibility=config["analysis"]["eligibility"],
    log:
        f"{LOGS}/compute_credit/{{config}}.{{pass_name}}.log",
    conda:
        "../../envs/analysis.yaml"
    script:
        "../scripts/compute_credit.py"
