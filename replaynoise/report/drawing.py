"""Drawing a figure so the same data gives the same bytes: built on ``matplotlib.figure.Figure`` with an Agg canvas,
never through pyplot (no global figure state leaks between calls), saved atomically without timestamps or tool
versions in the file metadata, so the results manifest stays stable across reruns."""

from __future__ import annotations

import os

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from replaynoise.io import atomic_path

PNG_METADATA = {"Software": None}
PDF_METADATA = {"CreationDate": None, "Producer": None, "Creator": None}

PathLike = str | os.PathLike


def new_figure(width: float = 7.0, height: float = 4.0) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, out_png: PathLike, out_pdf: PathLike, dpi: int = 150) -> None:
    """Save PNG and PDF atomically, without timestamps or version strings, so reruns give identical bytes."""
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi, metadata=PNG_METADATA)
    with atomic_path(out_pdf) as tmp:
        fig.savefig(tmp, format="pdf", metadata=PDF_METADATA)


def message_figure(message: str, title: str) -> Figure:
    fig = new_figure()
    ax = fig.add_subplot()
    ax.set_axis_off()
    ax.set_title(title)
    ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=14, transform=ax.transAxes)
    return fig


def finish(fig: Figure, ax: Axes, title: str, out_png: PathLike, out_pdf: PathLike, legend_size: int = 8) -> None:
    """A rate plot's ending: the y axis from zero, the title, the legend, and the files."""
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    save_figure(fig, out_png, out_pdf)
