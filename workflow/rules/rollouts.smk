# One job per problem shard (resources.shard_size), gathered into one table per configuration.
rule generate_rollouts:
    input:
        problems=problems_file(),
        model=model_dir,
    output:
        rollouts=rollout_shard_file("{config}", "{shard}"),
        kv=directory(kv_dir("{config}", "{shard}")),
    log:
        f"{LOGS}/generate_rollouts/{{config}}.{{shard}}.log",
    benchmark:
        benchmark_file("generate_rollouts", "{config}.{shard}")
    conda:
        engine_env
    threads: heavy("generate_rollouts", "threads")
    resources:
        mem_mb=heavy("generate_rollouts", "mem_mb"),
        runtime=heavy("generate_rollouts", "runtime"),
        gpu=gpus,
        gpu_gib=gpu_gib,
    params:
        code=code_version("generate_rollouts"),
        settings=rollout_settings,
        seed=config["seed"],
        prompt=config["prompt"],
        pivots=config["pivots"],
        rollouts=ROLLOUT_BLOCK,
        # read only to name a problem whose prompt does not fit by its file and line
        dataset=dict(source=config["dataset"]["source"], path=config["dataset"]["path"], cache=PACKAGE_DIR),
        topk=config["pivots"]["topk"],
        shard_size=config["resources"]["shard_size"],
        work=work_dir("{config}", "rollouts", "{shard}"),
    script:
        "../scripts/generate_rollouts.py"


rule gather_rollouts:
    input:
        lambda w: [rollout_shard_file(w.config, s) for s in SHARDS],
    output:
        rollouts_file("{config}"),
    log:
        f"{LOGS}/gather_rollouts/{{config}}.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("gather"),
    script:
        "../scripts/gather.py"


# Every pass shard reads the KV folders of all rollout shards; it depends on this one small index of them.
rule index_kv:
    input:
        kv_dirs,
    output:
        kv_index_file("{config}"),
    log:
        f"{LOGS}/index_kv/{{config}}.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("index_kv"),
    script:
        "../scripts/index_kv.py"
