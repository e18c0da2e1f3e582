"""Bitwise agreement of passes, channel by channel: which rows, tokens, answers, first-step log-probs, success
counts and credit estimates two passes share exactly. Under batch-invariant execution every channel of the passes
that draw the same noise must agree, so a difference there is a bug and the step fails."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np
import polars as pl

from replaynoise.generation.passes import pass_spec

# ---------------------------------------------------------------------------------------- channel checks

_ROW_KEYS = ("pivot_id", "branch", "k")
_ROW_CHANNELS = ("token_ids", "answer", "correct", "next_topk_ids", "next_topk_logprobs")


def lists_bitwise_equal(a: pl.Series, b: pl.Series) -> np.ndarray:
    """Row-wise equality of two list columns, bit for bit (-0.0 != 0.0, NaN == NaN of equal payload).

    polars' own list equality treats -0.0 and 0.0 as equal, which would hide a numerics difference in the
    invariant-mode check.
    """
    if len(a) != len(b):
        raise ValueError("list columns of different lengths")
    null_a, null_b = a.is_null().to_numpy(), b.is_null().to_numpy()
    len_a = a.list.len().fill_null(-1).to_numpy()
    len_b = b.list.len().fill_null(-1).to_numpy()
    equal = (null_a & null_b) | (~null_a & ~null_b & (len_a == len_b))
    check = equal & (len_a > 0)
    if not check.any():
        return equal
    idx = np.flatnonzero(check)
    mask = pl.Series(check)
    flat_a, flat_b = a.filter(mask).explode(), b.filter(mask).explode()
    lengths = len_a[idx]
    if len(flat_a) != lengths.sum() or len(flat_b) != lengths.sum():
        raise RuntimeError("unexpected explode length")
    inner_null = flat_a.is_null().to_numpy() != flat_b.is_null().to_numpy()
    va = _bits(flat_a)
    vb = _bits(flat_b)
    mismatch = (va != vb) | inner_null
    row = np.repeat(np.arange(idx.size), lengths)
    bad_rows = np.bincount(row, weights=mismatch.astype(np.float64), minlength=idx.size) > 0
    equal[idx[bad_rows]] = False
    return equal


def _bits(s: pl.Series) -> np.ndarray:
    """Values as integers carrying their exact bit pattern (nulls as 0; null masks are compared apart)."""
    if s.dtype.is_float():
        arr = s.cast(pl.Float64).fill_null(0.0).to_numpy()
        return np.ascontiguousarray(arr).view(np.int64)
    if s.dtype.is_integer() or s.dtype == pl.Boolean:
        return s.cast(pl.Int64).fill_null(0).to_numpy()
    return np.asarray([hash(v) for v in s.to_list()], dtype=np.int64)


def _share_row(pass_a: str, pass_b: str, channel: str, same: np.ndarray) -> dict:
    n = int(same.size)
    return {
        "pass_a": pass_a,
        "pass_b": pass_b,
        "channel": channel,
        "n": n,
        "share_identical": float(same.mean()) if n else None,
    }


def _row_frame(name: str, df: pl.DataFrame, keep: tuple[str, ...] = ()) -> pl.DataFrame:
    """Key columns with one dtype in every pass, and a refusal of duplicated rows (a join would multiply them)."""
    out = df.select(
        pl.col("pivot_id").cast(pl.String),
        pl.col("branch").cast(pl.String),
        pl.col("k").cast(pl.Int64),
        *_ROW_CHANNELS,
        *keep,
    )
    if out.select(_ROW_KEYS).is_duplicated().any():
        raise ValueError(f"pass frame {name!r} has duplicated (pivot_id, branch, k) rows")
    return out


def row_identity(
    name_a: str, df_a: pl.DataFrame, name_b: str, df_b: pl.DataFrame, keep: tuple[str, ...] = ()
) -> tuple[pl.DataFrame, int]:
    """The rows present in both passes (joined on pivot, branch, k; ``keep``: columns of ``df_a`` carried along)
    with one boolean per row channel, bitwise: token_ids, answer, correct, next_topk (top-k ids and log-probs);
    and the size of the union of their rows."""
    for name, df in ((name_a, df_a), (name_b, df_b)):
        missing = [c for c in (*_ROW_KEYS, *_ROW_CHANNELS) if c not in df.columns]
        if missing:
            raise ValueError(f"pass frame {name!r} lacks columns {missing}")
    left, right = _row_frame(name_a, df_a, keep), _row_frame(name_b, df_b)
    joined = left.join(right, on=list(_ROW_KEYS), how="inner", suffix="__b")
    n_union = left.select(_ROW_KEYS).vstack(right.select(_ROW_KEYS)).unique().height
    col = joined.get_column
    same = [pl.Series("token_ids", lists_bitwise_equal(col("token_ids"), col("token_ids__b")))]
    same += [
        pl.Series(ch, joined.select(pl.col(ch).eq_missing(pl.col(f"{ch}__b")))[ch].to_numpy().astype(bool))
        for ch in ("answer", "correct")
    ]
    same.append(
        pl.Series(
            "next_topk",
            lists_bitwise_equal(col("next_topk_ids"), col("next_topk_ids__b"))
            & lists_bitwise_equal(col("next_topk_logprobs"), col("next_topk_logprobs__b")),
        )
    )
    return joined.select(*_ROW_KEYS, *keep).with_columns(same), n_union


def _row_channels(name_a: str, df_a: pl.DataFrame, name_b: str, df_b: pl.DataFrame) -> list[dict]:
    same, n_union = row_identity(name_a, df_a, name_b, df_b)
    rows = [
        {
            "pass_a": name_a,
            "pass_b": name_b,
            "channel": "rows_present",
            "n": n_union,
            "share_identical": same.height / n_union if n_union else None,
        }
    ]
    for ch in ("token_ids", "answer", "correct", "next_topk"):
        rows.append(_share_row(name_a, name_b, ch, same[ch].to_numpy().astype(bool)))
    return rows


def _pivot_channels(name_a: str, cr_a: pl.DataFrame, name_b: str, cr_b: pl.DataFrame) -> list[dict]:
    cols = ("pivot_id", "n_orig_correct", "n_sub_correct", "a_hat", "n_rows")
    joined = (
        cr_a.select(cols)
        .join(cr_b.select(cols), on="pivot_id", how="inner", suffix="__b")
        .filter((pl.col("n_rows") > 0) & (pl.col("n_rows__b") > 0))
    )
    counts = (
        joined.select(
            (pl.col("n_orig_correct") == pl.col("n_orig_correct__b"))
            & (pl.col("n_sub_correct") == pl.col("n_sub_correct__b"))
        )
        .to_series()
        .to_numpy()
        .astype(bool)
    )
    a_hat = lists_bitwise_equal(_as_singleton_lists(joined["a_hat"]), _as_singleton_lists(joined["a_hat__b"]))
    return [_share_row(name_a, name_b, "success_counts", counts), _share_row(name_a, name_b, "a_hat", a_hat)]


def _as_singleton_lists(s: pl.Series) -> pl.Series:
    """Wrap scalars in one-element lists so the bitwise list comparison covers scalar floats too."""
    return s.to_frame("v").select(pl.concat_list(pl.col("v").cast(pl.Float64))).to_series()


def _samples(name: str) -> bool:
    """Whether pass ``name`` runs on a sample of the pivots (``serial``); unknown names (tests) do not."""
    try:
        return pass_spec(name).sample_key is not None
    except ValueError:
        return False


def _on_common_pivots(
    name_a: str, df_a: pl.DataFrame, name_b: str, df_b: pl.DataFrame
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Both frames restricted to the pivots of whichever runs on a sample: a pass over 50 pivots is compared
    with the other's rows of those pivots, not counted as missing the rest."""
    for name, df in ((name_a, df_a), (name_b, df_b)):
        if _samples(name):
            ids = df["pivot_id"].unique().to_list()
            df_a, df_b = df_a.filter(pl.col("pivot_id").is_in(ids)), df_b.filter(pl.col("pivot_id").is_in(ids))
    return df_a, df_b


def channel_agreement(passes: Mapping[str, pl.DataFrame], credit: Mapping[str, pl.DataFrame]) -> pl.DataFrame:
    """Share of bitwise-identical values per channel, for every unordered pair of passes.

    Row channels join continuations on (pivot_id, branch, k); pivot channels join credit frames on pivot_id
    over pivots with rows in both passes. 'rows_present' is the share of the union of rows present in both,
    so a pass that lost rows cannot look identical on the others.
    """
    rows: list[dict] = []
    for name_a, name_b in itertools.combinations(sorted(passes), 2):
        df_a, df_b = _on_common_pivots(name_a, passes[name_a], name_b, passes[name_b])
        rows += _row_channels(name_a, df_a, name_b, df_b)
        if name_a in credit and name_b in credit:
            rows += _pivot_channels(name_a, credit[name_a], name_b, credit[name_b])
    schema = {
        "pass_a": pl.String,
        "pass_b": pl.String,
        "channel": pl.String,
        "n": pl.Int64,
        "share_identical": pl.Float64,
    }
    return pl.DataFrame(rows, schema=schema)


def _numerics(name: str) -> tuple | None:
    """What a pass's numbers may differ by under batch-invariant kernels: its noise stream and the precision of
    its continuation; None for a pass whose prefix is computed at another precision (it differs by design)."""
    source = pass_spec(name).source
    return None if source.prefix_dtype else (pass_spec(name).noise, source.continuation_dtype)


def same_noise(agreement_df: pl.DataFrame) -> pl.DataFrame:
    """The pairs of passes that draw the same sampling noise (exact, replica, refeed: common random numbers) at
    the same precision.

    selector and replica_fresh use other seeds by design, so even batch-invariant kernels give other tokens there;
    a precision arm computes its prefix or its continuation at another precision than the passes it is set against.
    Transplants are compared: under invariant kernels the caches they swap are equal, so they must be too.
    """
    keep = [
        _numerics(a) is not None and _numerics(a) == _numerics(b)
        for a, b in zip(agreement_df["pass_a"], agreement_df["pass_b"])
    ]
    return agreement_df.filter(pl.Series(keep, dtype=pl.Boolean))


def assert_all_identical(agreement_df: pl.DataFrame) -> None:
    """Invariant mode: every channel of every pair of passes that share their noise must be identical; anything
    else is a bug (method.md §2). Pairs with a fresh-seed pass are left out (``same_noise``)."""
    agreement_df = same_noise(agreement_df)
    if agreement_df.height == 0:
        raise AssertionError("no pass pairs were compared: invariant check has nothing to assert")
    bad = agreement_df.filter(pl.col("share_identical").is_null() | (pl.col("share_identical") != 1.0))
    if bad.height:
        lines = [
            f"  {r['pass_a']} vs {r['pass_b']} / {r['channel']}: share_identical="
            f"{'n/a (nothing compared)' if r['share_identical'] is None else repr(r['share_identical'])}"
            f" over n={r['n']}"
            for r in bad.iter_rows(named=True)
        ]
        raise AssertionError("passes are not identical under invariant mode:\n" + "\n".join(lines))
