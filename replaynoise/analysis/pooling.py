"""Pooling configurations: their credit tables as one, compared as one configuration, where they share the
settings a pooled comparison keeps apart (``analysis.groups.POOL_KEYS``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from replaynoise.analysis.comparison import compare_passes
from replaynoise.analysis.conditionings import CONDITIONING_DEFINITIONS, CONDITIONINGS
from replaynoise.analysis.groups import POOL_KEYS
from replaynoise.settings import AnalysisSettings

#: The pooled comparison's probe note: the probe needs each configuration's pass rows.
POOLED_PROBE_REASON = "not pooled: the probe channel is in each configuration's comparison.json"


def pool_credit(credits: Mapping[str, Mapping[str, pl.DataFrame]], sep: str = "::") -> dict[str, pl.DataFrame]:
    """Concatenate configurations' credit frames per pass, with pivots and problems made config-qualified.

    Problem clusters of the pooled analysis are (config, problem): the same problem under two configurations
    is two clusters. Only passes present in every configuration are pooled, so each pooled pass covers the
    same pivots.
    """
    if not credits:
        raise ValueError("no configurations to pool")
    common = set.intersection(*(set(c) for c in credits.values()))
    pooled = {}
    for name in sorted(common):
        parts = [
            df.with_columns(
                (pl.lit(f"{cfg}{sep}") + pl.col("pivot_id").cast(pl.String)).alias("pivot_id"),
                (pl.lit(f"{cfg}{sep}") + pl.col("problem_id").cast(pl.String)).alias("problem_id"),
                pl.lit(cfg, dtype=pl.String).alias("config"),
            )
            for cfg, passes in credits.items()
            for df in [passes[name]]
        ]
        pooled[name] = pl.concat(parts, how="vertical_relaxed")
    return pooled


#: What configurations must share to be pooled. A stock engine's floor and re-feed rate come from its kernels'
#: batch dependence, which an invariant configuration does not have and another engine has in other measure;
#: pooled, they make a number that describes none of the runs.
def pool_groups(settings: Mapping[str, Mapping[str, Any]]) -> dict[tuple[str, ...], list[str]]:
    """Configuration names by their ``POOL_KEYS`` values, names sorted within a group, groups sorted."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name in sorted(settings):
        groups.setdefault(tuple(str(settings[name].get(key)) for key in POOL_KEYS), []).append(name)
    return dict(sorted(groups.items()))


def pooled_comparison(
    credits: Mapping[str, Mapping[str, pl.DataFrame]],
    settings: Mapping[str, Mapping[str, Any]],
    analysis: AnalysisSettings,
    analysis_hash: str,
) -> dict:
    """The pooled comparison of a run, for the workflow and a reference rebuild alike: configurations are pooled
    only when they share engine, kernels, model, dtype and training; otherwise no pooled number is made, and
    every conditioning says why, naming the groups, so the pooled rows of the tables read n/a with that note
    instead of mixing them.
    A run of one group gives exactly the pooled analysis (the same file as before the rule existed)."""
    configs = sorted(credits)
    if sorted(settings) != configs:
        raise ValueError(f"pooling: settings for {sorted(settings)}, credit tables for {configs}")
    groups = pool_groups(settings)
    if len(groups) == 1:
        result = compare_passes(pool_credit(credits), analysis, probe_reason=POOLED_PROBE_REASON)
    else:
        listed = "; ".join(f"{'/'.join(key)}: {', '.join(names)}" for key, names in groups.items())
        reason = f"not pooled: the configurations differ in {' or '.join(POOL_KEYS)} ({listed})"
        result = {
            "metric": analysis.metric,
            "passes": sorted(set.intersection(*(set(c) for c in credits.values()))),
            "not_pooled": {
                "reason": reason,
                "keys": list(POOL_KEYS),
                "groups": [dict(zip(POOL_KEYS, key), configs=names) for key, names in groups.items()],
            },
            "conditionings": {
                cond: {"available": False, "reason": reason, "definition": CONDITIONING_DEFINITIONS[cond]}
                for cond in CONDITIONINGS
            },
        }
    result.update(config="pooled", configs=configs, analysis_hash=analysis_hash)
    return result
