from snakemake.utils import min_version

min_version("9.0")


configfile: f"{workflow.basedir}/config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/rollouts.smk"
include: "workflow/rules/pivots.smk"
include: "workflow/rules/replay.smk"
include: "workflow/rules/credit.smk"
include: "workflow/rules/analysis.smk"
include: "workflow/rules/figures.smk"
include: "workflow/rules/controls.smk"
include: "workflow/rules/manifest.smk"
include: "workflow/rules/cost.smk"


# Lost shards are targets too: a shard deleted between runs (a --forcerun interrupted after Snakemake deleted
# the step's output) is rebuilt by the next plain run, where Snakemake would keep a missing intermediate whose
# gathered table still exists.
rule all:
    default_target: True
    localrule: True
    input:
        lost_shards,
        MANIFEST,
        PROVENANCE,
        cost_file("md"),


# The run's answer on the terminal, so a first run ends with what it measured and where the files are.
onsuccess:
    if Path(table_file("headline", "csv")).is_file():
        try:  # a courtesy: a table it cannot read (an older layout) must not fail a run that succeeded
            print(run_summary(table_file("headline", "csv")))
        except Exception as exc:
            print(f"(no summary: {table_file('headline', 'csv')} could not be read: {exc})")
        print("Tables: results/tables/headline.{md,csv,tex}; figures: results/figures/; "
              "every file's sha256: results/MANIFEST.sha256")
