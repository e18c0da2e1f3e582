rule prepare_model:
    input:
        model_files,
    output:
        directory(model_path("{model_key}")),
    log:
        f"{LOGS}/prepare_model/{{model_key}}.log",
    benchmark:
        benchmark_file("prepare_model", "{model_key}")
    wildcard_constraints:
        model_key=one_of(MODEL_KEYS),
    conda:
        "../../envs/torch.yaml"
    threads: heavy("prepare_model", "threads")
    resources:
        mem_mb=heavy("prepare_model", "mem_mb"),
        runtime=heavy("prepare_model", "runtime"),
    params:
        code=code_version("prepare_model"),
        spec=lambda w: MODEL_KEYS[w.model_key]["model"],
        dtype=lambda w: MODEL_KEYS[w.model_key]["dtype"],
        cache=PACKAGE_DIR,
    script:
        "../scripts/prepare_model.py"
