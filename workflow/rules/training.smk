# A configuration with a train block measures its base model after GRPO: the trained model is one more prepared
# model, keyed by its base and its recipe (common.smk, model_key), and the figure and table say what training did.
# Its problems are chosen by a local step (a cluster's nodes may have no network to fetch the packaged set).
rule training_problems:
    input:
        excluded=excluded_problems,
    output:
        training_problems_file("{model_key}"),
    log:
        f"{LOGS}/training_problems/{{model_key}}.log",
    wildcard_constraints:
        model_key=one_of(TRAINED),
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("training_problems"),
        dataset=lambda w: TRAINED[w.model_key]["recipe"]["train"]["dataset"],
        per_step=lambda w: TRAINED[w.model_key]["recipe"]["train"]["prompts_per_step"],
        cache=PACKAGE_DIR,
    script:
        "../scripts/training_problems.py"


rule train_grpo:
    input:
        base=lambda w: model_path(TRAINED[w.model_key]["base"]),
        problems=training_problems_file("{model_key}"),
    output:
        model=directory(model_path("{model_key}")),
        log=training_log_file("{model_key}"),
    log:
        f"{LOGS}/train_grpo/{{model_key}}.log",
    benchmark:
        benchmark_file("train_grpo", "{model_key}")
    wildcard_constraints:
        model_key=one_of(TRAINED),
    conda:
        "../../envs/torch.yaml"
    threads: heavy("train_grpo", "threads")
    resources:
        mem_mb=heavy("train_grpo", "mem_mb"),
        runtime=heavy("train_grpo", "runtime"),
        gpu=lambda w: job_gpus(TRAINED[w.model_key]["settings"]),
    params:
        code=code_version("train_grpo"),
        recipe=lambda w: TRAINED[w.model_key]["recipe"],
        dtype=lambda w: TRAINED[w.model_key]["settings"]["dtype"],
        work=lambda w: f"results/work/training/{w.model_key}",
    script:
        "../scripts/train_grpo.py"


rule figure_training:
    input:
        logs=[training_log_file(key) for key in sorted(TRAINED)],
    output:
        png=report(
            figure_file("training", "png"),
            caption="../report/training.rst",
            category="Figures",
        ),
        pdf=figure_file("training", "pdf"),
    log:
        f"{LOGS}/figure_training.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("figure_training"),
        models=sorted(TRAINED),
    script:
        "../scripts/figure_training.py"


# Accuracy and entropy of each configuration's rollouts on the evaluation problems: before and after training,
# where a run measures a base model beside its trained one.
rule policy_table:
    input:
        rollouts=[rollouts_file(c) for c in CONFIGS],
    output:
        csv=table_file("policy", "csv"),
        md=table_file("policy", "md"),
    log:
        f"{LOGS}/policy_table.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("policy_table"),
        configs=CONFIGS,
        models={c: model_key(c) for c in CONFIGS},
        ci=config["analysis"]["ci"],
    script:
        "../scripts/policy_table.py"
