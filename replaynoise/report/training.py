"""What training did, in the report: the training curves, and each configuration's policy on the evaluation
problems (accuracy and entropy of its rollouts), so a trained model's row sits beside its base's."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import polars as pl

from replaynoise.analysis.paper_stats import cluster_ols_mean
from replaynoise.generation.training_log import read_training_log
from replaynoise.io import write_text
from replaynoise.report.drawing import new_figure, save_figure

#: Panels of the training figure: log column, axis label.
PANELS = (
    ("reward", "train reward (fraction correct)"),
    ("entropy", "token entropy (nats, at train.temperature)"),
    ("kl", "KL to the base model"),
    ("completion_length", "completion tokens (mean)"),
)


def plot_training(
    logs: Mapping[str, str | os.PathLike], out_png: str | os.PathLike, out_pdf: str | os.PathLike, smooth: int = 5
) -> None:
    """One panel per logged quantity against the optimizer step, one line per trained model; the reward also
    as a running mean over ``smooth`` steps, since one step's group of prompts is small."""
    fig = new_figure(10.0, 6.5)
    axes = fig.subplots(2, 2, sharex=True).ravel()
    for name, path in logs.items():
        log = read_training_log(path)
        for ax, (column, label) in zip(axes, PANELS):
            values = log[column].to_numpy().astype(float)
            if column == "reward" and log.height >= smooth:
                ax.plot(log["step"], values, alpha=0.35, lw=1)
                run = np.convolve(values, np.ones(smooth) / smooth, mode="valid")
                ax.plot(log["step"][smooth - 1 :], run, lw=2, label=f"{name} ({smooth}-step mean)")
            else:
                ax.plot(log["step"], values, lw=1.5, label=name)
            ax.set_ylabel(label, fontsize=9)
            ax.grid(alpha=0.3)
    for ax in axes[2:]:
        ax.set_xlabel("optimizer step")
    axes[0].legend(fontsize=7)
    fig.suptitle("GRPO training (TRL), per optimizer step")
    fig.tight_layout()
    save_figure(fig, out_png, out_pdf)


def entropy_lower_bound(topk_logprobs: np.ndarray) -> np.ndarray:
    """A lower bound of each position's entropy (nats) from its top-k log-probs: the tail lumped into one outcome
    (merging outcomes never raises entropy). The recorded log-probs are the untempered distribution's."""
    p = np.exp(topk_logprobs)
    tail = np.clip(1.0 - p.sum(-1), 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        head = -np.where(p > 0, p * np.log(p), 0.0).sum(-1)
        rest = -np.where(tail > 0, tail * np.log(tail), 0.0)
    return head + rest


def policy_row(config: str, model: str, rollouts: pl.DataFrame, ci: float) -> dict:
    """Accuracy (problem-clustered CI) and mean token entropy of one configuration's rollouts."""
    groups = rollouts["problem_id"].to_numpy()
    accuracy = cluster_ols_mean(rollouts["correct"].cast(pl.Float64).to_numpy(), groups, ci)
    per_rollout = [
        float(entropy_lower_bound(np.asarray(lps, dtype=np.float64)).mean()) if len(lps) else np.nan
        for lps in rollouts["topk_logprobs"].to_list()
    ]
    per_rollout = np.asarray(per_rollout)
    responded = np.isfinite(per_rollout)  # an empty response has no position to average over
    entropy = cluster_ols_mean(per_rollout[responded], groups[responded], ci)
    lengths = rollouts["response_ids"].list.len()
    return {
        "config": config,
        "model": model,
        "problems": rollouts["problem_id"].n_unique(),
        "rollouts": rollouts.height,
        "accuracy": accuracy["coef"],
        "accuracy_lo": accuracy["ci_lo"],
        "accuracy_hi": accuracy["ci_hi"],
        "entropy_lb": entropy["coef"],
        "entropy_lb_lo": entropy["ci_lo"],
        "entropy_lb_hi": entropy["ci_hi"],
        "response_tokens": float(lengths.mean()),
        "finished": float((rollouts["finish_reason"] != "length").mean()),
    }


def policy_table(rollouts: Mapping[str, pl.DataFrame], models: Mapping[str, str], ci: float) -> pl.DataFrame:
    return pl.DataFrame([policy_row(c, models[c], df, ci) for c, df in rollouts.items()])


def render_policy_markdown(table: pl.DataFrame, ci: float) -> str:
    pct = round(ci * 100)
    lines = [
        f"| config | model | problems | rollouts | accuracy [{pct}% CI] | token entropy, lower bound (nats) "
        f"[{pct}% CI] | response tokens | finished |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table.iter_rows(named=True):
        lines.append(
            f"| {r['config']} | {r['model']} | {r['problems']} | {r['rollouts']} | "
            f"{_pct(r['accuracy'])} [{_pct(r['accuracy_lo'])}, {_pct(r['accuracy_hi'])}] | "
            f"{_num(r['entropy_lb'])} [{_num(r['entropy_lb_lo'])}, {_num(r['entropy_lb_hi'])}] | "
            f"{r['response_tokens']:.1f} | {_pct(r['finished'])} |"
        )
    lines += [
        "",
        "Accuracy: the share of rollouts whose final answer is correct, CI clustered by problem. Token "
        "entropy: per position, a lower bound from the top-k log-probs of the untempered distribution with "
        "the tail lumped into one outcome; averaged over a rollout's positions, then over rollouts (CI "
        "clustered by problem). finished: rollouts that ended before their token budget.",
    ]
    return "\n".join(lines) + "\n"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def write_policy_tables(table: pl.DataFrame, ci: float, out_csv: str | os.PathLike, out_md: str | os.PathLike) -> None:
    write_text(table.write_csv(), out_csv)
    write_text(render_policy_markdown(table, ci), out_md)
