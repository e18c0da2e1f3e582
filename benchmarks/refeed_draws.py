"""The excess of a committed reference against each of its re-feed draws: refeed, and refeed_replica (the re-feed's
second draw, the same requests in other batches), each set against the one replica, from the committed credit
tables alone. Two interchangeable draws of one pass that give different excesses are what one draw per pass cannot
tell from an effect (docs/method.md section 4, "Replicated passes").

    python benchmarks/refeed_draws.py reference/gpu-vllm/paper-qwen OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replaynoise.analysis.comparison import compare_passes  # noqa: E402
from replaynoise.generation.passes import draws, run_passes  # noqa: E402
from replaynoise.io import read_json, read_parquet  # noqa: E402
from replaynoise.settings import AnalysisSettings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reference", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    config = read_json(args.reference / "provenance.json")["config"]
    settings = AnalysisSettings.of(config["analysis"], config["seed"])
    passes = run_passes(config["replay"])
    out = {
        "reference": str(args.reference),
        "command": f"python benchmarks/refeed_draws.py {args.reference} {args.out}",
        "configs": {},
    }
    for cfg in sorted(config["configs"]):
        credit = {p: read_parquet(args.reference / "credit" / cfg / f"{p}.parquet") for p in passes}
        rows = {}
        for draw in draws(passes, "refeed"):
            result = compare_passes(
                {"exact": credit["exact"], "replica": credit["replica"], "refeed": credit[draw]}, settings
            )
            rows[draw] = {}
            for cond in ("main", "treatment_independent"):
                block = result["conditionings"][cond]
                rows[draw][cond] = {
                    "n": block["n"],
                    "n_problems": block["n_problems"],
                    "excess_pp": block.get("excess_pp"),
                    "per_problem_t": (block.get("per_problem_t") or {}).get("t"),
                }
        out["configs"][cfg] = rows
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for cfg, rows in out["configs"].items():
        for draw, conds in rows.items():
            e = conds["main"]["excess_pp"]
            print(
                f"{cfg} {draw}: main n {conds['main']['n']}, excess {e['estimate']:+.1f} pp "
                f"[{e['ci_lo']:+.1f}, {e['ci_hi']:+.1f}], per-problem t {conds['main']['per_problem_t']:.2f}"
            )


if __name__ == "__main__":
    main()
