"""``report --plot``: where each rank built each chunk's transposes, per step (matplotlib)."""

from __future__ import annotations

from typing import List

__all__ = ["plot_slots", "shown_slot"]


def shown_slot(r: dict) -> int:
    """The observed slot where the record has one, else the slot the aligner reports."""
    return r["obs_slot"] if r.get("obs_slot") is not None else r["slot"]


def plot_slots(records: List[dict], path: str) -> None:
    """One panel per chunk: the slot at which each pipeline rank built it, per step."""
    from nemo_fp8_align.planner.gantt import require_matplotlib

    plt = require_matplotlib()
    from matplotlib.ticker import MaxNLocator

    chunks = sorted({r["chunk"] for r in records})
    ranks = sorted({r["pp_rank"] for r in records})
    fig, axes = plt.subplots(1, len(chunks), figsize=(4.5 * len(chunks), 3.6), squeeze=False,
                             sharey=True)
    colours = plt.get_cmap("tab10")
    for ax, chunk in zip(axes[0], chunks):
        recs = [r for r in records if r["chunk"] == chunk]
        for aligned in sorted({r["aligned_slot"] for r in recs}):
            ax.axhline(aligned, color="black", linestyle="--", linewidth=1)
        for i, rank in enumerate(ranks):
            mine = [r for r in recs if r["pp_rank"] == rank and r["dp_rank"] == min(
                x["dp_rank"] for x in recs)]
            offset = (i - (len(ranks) - 1) / 2) * 0.08  # side by side where slots coincide
            ax.scatter([r["step"] + offset for r in mine], [shown_slot(r) for r in mine],
                       color=colours(i), label=f"pp rank {rank}", s=36,
                       marker="o" if all(r["after_all_gather"] for r in mine) else "x")
        ax.set_title(f"chunk {chunk} (dashed: aligned slot)", fontsize=10)
        ax.set_xlabel("training step")
        ax.set_xticks(sorted({r["step"] for r in recs}))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    top = max(shown_slot(r) for r in records)
    axes[0, 0].set_ylim(-0.6, top + 0.6)
    axes[0, 0].set_ylabel("schedule slot of the transposes")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(ranks), fontsize=8, frameon=False)
    seen = "observed" if any(r.get("obs_slot") is not None for r in records) else "reported"
    fig.suptitle(f"where each rank built each chunk's FP8 transposes ({seen}; policy "
                 f"{records[0]['policy']}; x: before the all-gather finished)", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
