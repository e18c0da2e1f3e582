# The controls of method.md section 7 (cache transplants, precision arms): their figures and table, planned only
# where replay.passes runs such passes (replaynoise.plan.control_outputs).
for _fig in CONTROL_FIGURES:

    rule:
        name:
            f"figure_{_fig}"
        input:
            comparisons=all_comparisons,
        output:
            **figure_outputs(_fig),
        log:
            f"{LOGS}/figure_{_fig}.log",
        localrule: True
        conda:
            "../../envs/analysis.yaml"
        params:
            code=code_version("control_report"),
            figure=_fig,
            configs=CONFIGS,
        script:
            "../scripts/control_report.py"


for _table in CONTROL_TABLES:

    rule:
        name:
            f"table_{_table}"
        input:
            comparisons=all_comparisons,
        output:
            csv=report(table_file(_table, "csv"), caption=f"../report/{_table}.rst", category="Tables"),
            md=table_file(_table, "md"),
        log:
            f"{LOGS}/table_{_table}.log",
        localrule: True
        conda:
            "../../envs/analysis.yaml"
        params:
            code=code_version("control_report"),
            table=_table,
            configs=CONFIGS,
            analysis_hash=ANALYSIS_HASH,
        script:
            "../scripts/control_report.py"
