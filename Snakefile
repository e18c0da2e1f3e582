from snakemake.utils import min_version

min_version("9.0")


configfile: f"{workflow.basedir}/config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/training.smk"
include: "workflow/rules/rollouts.smk"
include: "workflow/rules/pivots.smk"
include: "workflow/rules/replay.smk"
include: "workflow/rules/credit.smk"
include: "workflow/rules/analysis.smk"
include: "workflow/rules/figures.smk"
include: "workflow/rules/controls.smk"
include: "workflow/rules/manifest.smk"
include: "workflow/rules/cost.smk"
include: "workflow/rules/regime.smk"


# The report opens on the run's answer once the manifest step has written it (results/report.rst).
report: report_page()


# Every output of every rule in the plan is a target, intermediates included: a file deleted between runs (a
# --forcerun interrupted after Snakemake deleted the step's output) is rebuilt by the next plain run, where
# Snakemake would keep a missing intermediate whose downstream files still exist.
rule all:
    default_target: True
    input:
        manifest_inputs,
        MANIFEST,
        PROVENANCE,
        LANDING,
        cost_file("md"),
        cost_file("csv"),
    localrule: True


# What this machine lacks for a configuration (vLLM, a GPU) stops the run before its first job; onstart runs
# only when jobs are about to run (not in a dry run) and is skipped for jobs a cluster's nodes run.
onstart:
    # the main process holds the resolved results folder until it exits: a second run on the same folder, through
    # a link from another working directory too, stops here instead of deleting the first one's temporaries
    if workflow.is_main_process:
        try:
            hold_folder("results")
        except FolderBusyError as exc:
            raise WorkflowError(str(exc))
    if workflow.local_exec:
        _missing = platform_problems(
            config, conda=DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method
        )
        if _missing:
            raise WorkflowError("this machine cannot run the configuration:\n  " + "\n  ".join(_missing))


# The run's answer on the terminal, so a first run ends with what it measured and where the files are.
onsuccess:
    if Path(table_file("headline", "csv")).is_file():
        try:  # a courtesy: a table it cannot read (an older layout) must not fail a run that succeeded
            on_cpu = all(str(c.get("device", "cpu")).startswith("cpu") for c in config["configs"].values())
            print(run_summary(table_file("headline", "csv"), config["figures"]["conditioning"], cpu=on_cpu))
        except Exception as exc:
            print(f"(no summary: {table_file('headline', 'csv')} could not be read: {exc})")
        print(
            "Tables: results/tables/headline.{md,csv,tex}; figures: results/figures/; every file's sha256: "
            "results/MANIFEST.sha256; the report, which opens on these rows: snakemake --report "
            "results/report.html"
        )
