"""The benchmarks' curve figures: one line per row, the mean over its seeds with a band from their min to max."""

from __future__ import annotations

import numpy as np


def draw_seed_band(axes, name: str, curves: np.ndarray, values: np.ndarray) -> None:
    """Plot `values` (seeds x points) against each of the first len(axes) columns of `curves` (seeds x points x
    columns: x-axes such as compute, bytes and rounds), labelled with the row's name and seed count."""
    seeds = f"{len(curves)} seed{'s' if len(curves) > 1 else ''}"
    style = "--" if len(axes[0].get_lines()) >= 10 else "-"  # the colour cycle has ten: dash the ones that repeat
    for column, ax in enumerate(axes):
        x = curves[0, :, column]
        line, = ax.plot(x, values.mean(0), style, marker="o", ms=3, label=f"{name} ({seeds})")
        if len(curves) > 1:
            ax.fill_between(x, values.min(0), values.max(0), color=line.get_color(), alpha=0.15)


def label_and_save(fig, axes, ylabel: str, title: str, path, bytes_note: str = "") -> None:
    """Name the three x-axes (compute, uplink bytes, rounds) and the y-axis, add the legend and title, save."""
    for ax, label in zip(axes, ["client compute (forward-pass equivalents, whole federation)",
                                f"uplink bytes per client (cumulative{bytes_note})", "rounds"], strict=True):
        ax.set(xlabel=label, ylabel=ylabel)
    axes[0].legend(fontsize="x-small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
