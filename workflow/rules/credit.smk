rule compute_credit:
    input:
        passes=lambda w: pass_file(w.config, w.pass_name),
        pivots=pivots_file("{config}"),
    output:
        credit_file("{config}", "{pass_name}"),
    log:
        f"{LOGS}/compute_credit/{{config}}.{{pass_name}}.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("compute_credit"),
        k=config["replay"]["k"],
        eligibility=config["analysis"]["eligibility"],
    script:
        "../scripts/compute_credit.py"
