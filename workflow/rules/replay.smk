# One rule per pass, each a separately cached step (method.md section 2). They differ only in the pass name,
# which decides the prefix source and the noise stream (replaynoise.generation.passes.pass_spec). Each runs one job per
# shard, over an equal share of the pass's batches, gathered by gather_pass.
for _pass in RUN_PASSES:

    rule:
        name:
            f"replay_{_pass}"
        input:
            model=model_dir,
            rollouts=rollouts_file("{config}"),
            kv=kv_index_file("{config}"),
            pivots=pivots_file("{config}"),
        output:
            pass_shard_file("{config}", _pass, "{shard}"),
        log:
            f"{LOGS}/replay_{_pass}/{{config}}.{{shard}}.log",
        benchmark:
            benchmark_file(f"replay_{_pass}", "{config}.{shard}")
        priority: pass_priority(_pass)
        conda:
            engine_env
        threads: heavy("replay", "threads")
        resources:
            mem_mb=heavy("replay", "mem_mb"),
            runtime=heavy("replay", "runtime"),
            gpu=gpus,
            gpu_gib=gpu_gib,
        params:
            code=code_version("replay_pass"),
            pass_name=_pass,
            settings=pass_settings,
            seed=config["seed"],
            # the replay block but for its list of passes and other passes' sample sizes: adding a pass (a
            # control), or resizing another's sample, reruns no other pass
            replay=replay_params(_pass),
            topk=config["pivots"]["topk"],
            n_shards=len(SHARDS),
            work=work_dir("{config}", _pass, "{shard}"),
        script:
            "../scripts/replay_pass.py"


rule gather_pass:
    input:
        lambda w: [pass_shard_file(w.config, w.pass_name, s) for s in SHARDS],
    output:
        pass_file("{config}", "{pass_name}"),
    log:
        f"{LOGS}/gather_pass/{{config}}.{{pass_name}}.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("gather"),
    script:
        "../scripts/gather.py"
