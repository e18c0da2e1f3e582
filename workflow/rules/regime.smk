# The regime probe (replaynoise.generation.regime): a few problems' rollouts and one first step per branch and pass,
# in one engine's lifetime, so that a user learns in minutes whether and up to what length this engine's prefill
# reproduces its decode. Not part of `all`: run `snakemake regime` first, the campaign after.
rule regime_probe:
    input:
        problems=problems_file(),
        model=model_dir,
    output:
        summary=regime_file("{config}", "probe.json"),
        steps=regime_file("{config}", "first_steps.parquet"),
        mismatch=regime_file("{config}", "mismatch.parquet"),
        decode=regime_file("{config}", "decode.parquet"),
    log:
        f"{LOGS}/regime_probe/{{config}}.log",
    benchmark:
        benchmark_file("regime_probe", "{config}")
    conda:
        engine_env
    threads: heavy("replay", "threads")
    resources:
        mem_mb=heavy("replay", "mem_mb"),
        runtime=heavy("replay", "runtime"),
        gpu=gpus,
        gpu_gib=gpu_gib,
    params:
        code=code_version("regime_probe"),
        settings=settings,
        seed=config["seed"],
        prompt=config["prompt"],
        pivots=config["pivots"],
        rollouts=ROLLOUT_BLOCK,
        replay={key: value for key, value in config["replay"].items() if key not in ("passes", "replicates")},
        size=REGIME,
        topk=config["pivots"]["topk"],
        work=work_dir("{config}", "regime", "000"),
    script:
        "../scripts/regime_probe.py"


rule regime:
    input:
        [regime_file(c, "probe.json") for c in CONFIGS],
    output:
        regime_file("all", "regime.md"),
    log:
        f"{LOGS}/regime.log",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        code=code_version("regime_report"),
        configs=CONFIGS,
    script:
        "../scripts/regime_report.py"
