"""Every figure the workflow draws, by the name its rule, a reference's rebuild and a reanalysis call it
(``plan.FROM_COMPARISONS``, ``plan.FROM_CREDIT`` and the channel agreement)."""

from __future__ import annotations

from replaynoise.report import credit_figures, figures

PLOTS = {
    "disagreement": figures.plot_disagreement,
    "kinds_of_change": figures.plot_kinds_of_change,
    "jaccard_sweep": figures.plot_jaccard_sweep,
    "mismatch_flips": figures.plot_mismatch_flips,
    "channel_agreement": figures.plot_channel_agreement,
    "diff_histogram": credit_figures.plot_diff_histogram,
    "disagreement_vs_margin": credit_figures.plot_disagreement_vs_margin,
}
