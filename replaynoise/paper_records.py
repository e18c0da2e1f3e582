"""The paper's per-pivot result files read into one frame, checked value by value: one row per pivot, its three
estimates (Â^exact1, Â^exact2, Â^refeed) on the 1/K lattice of the K they were sampled with, its probe keys, and
what was read (files, K, duplicates dropped as the paper drops them)."""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl

from replaynoise.io import sha256_file

#: Our pass name -> the record key of its estimate.
PASS_KEYS = {"exact": "A_exact1", "replica": "A_exact2", "refeed": "A_refeed"}


#: Our pass name -> the suffix of the record's probe keys (compared against exact1 by the harness).
PROBE_SUFFIXES = {"replica": "exact2", "refeed": "refeed"}


REQUIRED_KEYS = ("problem_id", "rollout", "abs_pos", "margin", *PASS_KEYS.values())


#: Lattice tolerance: the records' Â are means of 0/1 rewards, exact multiples of 1/K up to float rounding.
LATTICE_EPS = 1e-9


def read_result_file(path: str | Path) -> dict:
    """One result file, gzip-compressed or plain JSON (told apart by its first bytes, not its name)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    try:
        data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except (OSError, EOFError, ValueError) as exc:  # ValueError: bad JSON, bad UTF-8, too many digits
        raise ValueError(f"{path}: not a readable JSON result file ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("pivots"), list):
        raise ValueError(f"{path}: not a per-pivot result file (no top-level 'pivots' list)")
    return data


def _lattice(value: Any, k: int, where: str) -> float:
    """Â snapped to its lattice point j/K, computed as our credit frames compute it (bitwise comparable)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{where}: {value!r} is not a finite number")
    j = round(value * k)
    if abs(value * k - j) > LATTICE_EPS or abs(j) > k:
        raise ValueError(f"{where}: {value!r} is not a multiple of 1/K in [-1, 1] for K={k}")
    return j / k


#: The types a record's fields must have (beyond the estimates, checked on their lattice): the pivot id is made
#: of the first three, and the rest become typed columns.
FIELD_TYPES = {
    "problem_id": (str, int),
    "rollout": (int,),
    "abs_pos": (int,),
    "margin": (int, float),
    "gen_index": (int, type(None)),
    "rollout_correct": (bool, int, type(None)),
    **{f"greedy_first_logprob_delta_{s}": (int, float, type(None)) for s in PROBE_SUFFIXES},
    **{f"greedy_divergence_{s}": (bool, int, type(None)) for s in PROBE_SUFFIXES},
}


def _check_fields(rec: dict, where: str) -> None:
    """A clear error naming the file, the pivot and the field, instead of a traceback from deep in the adapter."""
    for key, types in FIELD_TYPES.items():
        value = rec.get(key)
        if key not in rec and type(None) in types:
            continue
        wrong = not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        if not wrong and isinstance(value, float) and not math.isfinite(value):
            wrong = True
        if wrong:
            kinds = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ValueError(
                f"{where}: field {key!r} is {value!r}; expected {kinds}" + (" (finite)" if float in types else "")
            )


def _file_k(path: str | Path, data: dict, k: int | None) -> int:
    """The K a result file's estimates were sampled with: its config's, or ``k`` where it records none."""
    file_k = data.get("config", {}).get("k")
    if k is not None and file_k is not None and k != file_k:
        raise ValueError(
            f"{path}: --k {k} differs from the K of {file_k} its config records; the estimates "
            "are on the 1/K lattice of the K they were sampled with (leave --k out)"
        )
    use_k = k if k is not None else file_k
    if not isinstance(use_k, int) or use_k < 1:
        raise ValueError(f"{path}: no usable K in its config (k={file_k!r}); pass --k")
    return use_k


def _pivot_row(rec: dict, pivot_id: str, k: int, where: str) -> dict:
    """One pivot's row of the records frame (its fields already checked)."""
    ok = [rec[key] for key in ("cache_ok_exact1", "cache_ok_exact2") if key in rec]
    row = {
        "pivot_id": pivot_id,
        "problem_id": str(rec["problem_id"]),
        "t": rec.get("gen_index"),
        "prefix_len": rec["abs_pos"],
        "margin": float(rec["margin"]),
        "rollout_correct": None if rec.get("rollout_correct") is None else bool(rec["rollout_correct"]),
        "k": k,
        "verified": all(bool(v) for v in ok),
    }
    for name, key in PASS_KEYS.items():
        row[f"a_hat__{name}"] = _lattice(rec[key], k, f"{where} ({pivot_id}) {key}")
    for name, suffix in PROBE_SUFFIXES.items():
        delta, div = rec.get(f"greedy_first_logprob_delta_{suffix}"), rec.get(f"greedy_divergence_{suffix}")
        row[f"probe_delta__{name}"] = None if delta is None else float(delta)
        row[f"probe_diverged__{name}"] = None if div is None else bool(div)
    return row


def records_frame(paths: Sequence[str | Path], k: int | None = None) -> tuple[pl.DataFrame, dict]:
    """All pivots of ``paths`` as one frame (one row per pivot), and what was read (files, K, duplicates).

    pivot_id = "{problem_id}/r{rollout}@{abs_pos}". A pivot id seen again (the paper's C1 cohorts overlap) is
    dropped, keeping the first, as the paper deduplicates its C1 pool; the count is reported.
    """
    if not paths:
        raise ValueError("no result files given")
    files, rows, seen, dropped = [], [], set(), 0
    ks = set()
    for path in paths:
        data = read_result_file(path)
        use_k = _file_k(path, data, k)
        ks.add(use_k)
        config = data.get("config", {})
        files.append(
            {
                "path": str(path),
                "sha256": sha256_file(path),
                "n_pivots": len(data["pivots"]),
                "final": data.get("final"),
                "model": config.get("model"),
                "k": use_k,
            }
        )
        for i, rec in enumerate(data["pivots"]):
            where = f"{path}: pivot {i}"
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: not an object (a {type(rec).__name__})")
            missing = [key for key in REQUIRED_KEYS if key not in rec]
            if missing:
                raise ValueError(f"{where}: lacks key(s) {missing}")
            _check_fields(rec, where)
            pivot_id = f"{rec['problem_id']}/r{rec['rollout']}@{rec['abs_pos']}"
            if pivot_id in seen:
                dropped += 1
                continue
            seen.add(pivot_id)
            rows.append(_pivot_row(rec, pivot_id, use_k, where))
    if len(ks) > 1:
        raise ValueError(f"files of different K cannot be pooled: K values {sorted(ks)} in {list(map(str, paths))}")
    schema = {
        "pivot_id": pl.String,
        "problem_id": pl.String,
        "t": pl.Int64,
        "prefix_len": pl.Int64,
        "margin": pl.Float64,
        "rollout_correct": pl.Boolean,
        "k": pl.Int64,
        "verified": pl.Boolean,
    }
    schema |= {f"a_hat__{name}": pl.Float64 for name in PASS_KEYS}
    schema |= {f"probe_delta__{n}": pl.Float64 for n in PROBE_SUFFIXES}
    schema |= {f"probe_diverged__{n}": pl.Boolean for n in PROBE_SUFFIXES}
    info = {"files": files, "k": ks.pop(), "n_pivots": len(rows), "duplicates_dropped": dropped}
    return pl.DataFrame(rows, schema=schema), info
