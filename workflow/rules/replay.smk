# One rule per pass, each a separately cached step (method.md section 2). They differ only in the pass name,
# which decides the prefix source and the noise stream (replaynoise.replay.PASSES).
for _pass in RUN_PASSES:

    rule:
        name:
            f"replay_{_pass}"
        input:
            model=model_dir,
            rollouts="results/rollouts/{config}/rollouts.parquet",
            kv="results/rollouts/{config}/kv",
            pivots="results/pivots/{config}.parquet",
        output:
            pass_file("{config}", _pass),
        params:
            code=code_version("replay", "engines", "data", "seeds", "models", "provenance"),
            pass_name=_pass,
            settings=settings,
            seed=config["seed"],
            replay=config["replay"],
            topk=config["pivots"]["topk"],
            work=f"results/work/{{config}}/{_pass}",
        log:
            f"{LOGS}/replay_{_pass}/{{config}}.log",
        benchmark:
            f"{BENCH}/replay_{_pass}/{{config}}.tsv"
        threads: config["resources"]["threads"]
        resources:
            gpu=lambda w: int(settings(w)["device"].startswith("cuda")),
        conda:
            "../../envs/torch.yaml"
        script:
            "../scripts/replay_pass.py"
