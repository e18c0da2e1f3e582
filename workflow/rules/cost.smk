# Timings are not results: the statement reads the benchmark files after the manifest is written, and is
# itself kept out of the manifest (two identical runs take different times).
rule cost_report:
    input:
        MANIFEST,
    output:
        csv=cost_file("csv"),
        md=report(cost_file("md"), caption="../report/cost.rst", category="Compute"),
    log:
        f"{LOGS}/cost_report.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("cost_report"),
        jobs=timed_jobs(),
        prices=config["cost"],
    script:
        "../scripts/cost_report.py"
