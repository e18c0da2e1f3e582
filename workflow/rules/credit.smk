rule compute_credit:
    localrule: True
    input:
        passes=lambda w: pass_file(w.config, w.pass_name),
        pivots=pivots_file("{config}"),
    output:
        credit_file("{config}", "{pass_name}"),
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
