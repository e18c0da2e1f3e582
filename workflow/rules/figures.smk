# Each figure is its own rule, so a figure setting reruns only the figures that use it.
for _fig in FIGURES_FROM_COMPARISONS:

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
            code=code_version("figure"),
            figure=_fig,
            configs=CONFIGS,
            options=plot_options(_fig, config),
        script:
            "../scripts/figure.py"


for _fig in FIGURES_FROM_CREDIT:

    rule:
        name:
            f"figure_{_fig}"
        input:
            credit=all_credit,
        output:
            **figure_outputs(_fig),
        log:
            f"{LOGS}/figure_{_fig}.log",
        localrule: True
        conda:
            "../../envs/analysis.yaml"
        params:
            code=code_version("figure"),
            figure=_fig,
            configs=CONFIGS,
            passes=RUN_PASSES,
            options=plot_options(_fig, config),
        script:
            "../scripts/figure.py"


rule figure_channel_agreement:
    input:
        comparisons=all_comparisons,
        channels=[channels_file(c) for c in CONFIGS],
    output:
        **figure_outputs("channel_agreement"),
    log:
        f"{LOGS}/figure_channel_agreement.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("figure"),
        figure="channel_agreement",
        configs=CONFIGS,
        options=plot_options("channel_agreement", config),
    script:
        "../scripts/figure.py"


rule figures:
    input:
        [
            figure_file(name, ext)
            for name in FIGURES_FROM_COMPARISONS + FIGURES_FROM_CREDIT + ["channel_agreement"] + CONTROL_FIGURES
            for ext in ("png", "pdf")
        ],
    localrule: True


rule figure_mechanism:
    input:
        [mechanism_file(c) for c in CONFIGS],
    output:
        **figure_outputs("mechanism"),
        csv=table_file("mechanism", "csv"),
        md=table_file("mechanism", "md"),
    log:
        f"{LOGS}/figure_mechanism.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("figure_mechanism"),
        configs=CONFIGS,
    script:
        "../scripts/figure_mechanism.py"
