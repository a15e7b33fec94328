"""PNG Gantt charts of simulated timelines (matplotlib, an optional dependency)."""

from __future__ import annotations

from typing import List, Optional, Sequence

from nemo_fp8_align.planner.timeline import Timeline

__all__ = ["COLOURS", "plot_plan", "plot_timelines", "require_matplotlib", "warmup_window",
           "first_chunk_window"]

#: kind -> (colour, legend label); drawn in this order, so transposes end up on top of waits.
COLOURS = {
    "forward": ("#4c72b0", "forward"),
    "backward": ("#55a868", "backward"),
    "p2p_wait": ("#e0e0e0", "idle (pipeline wait)"),
    "gather_wait": ("#f0a030", "all-gather wait"),
    "host_wait": ("#8c8c8c", "host wait (first forward)"),
    "transpose": ("#d62728", "FP8 transposes"),
    "overlap_penalty": ("#9467bd", "side-stream slowdown"),
}


def require_matplotlib():
    """``matplotlib.pyplot`` with the Agg backend, or an ImportError saying how to install it."""
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("--plot needs matplotlib: pip install matplotlib (or the [plot] extra)") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def warmup_window(tl: Timeline) -> float:
    """End of the interesting part of a long step: every rank's first backward, plus two
    forward+backward pairs (the transposes all happen before it)."""
    first_bwd = max(min(i.start for i in tl.of_kind("backward", r)) for r in range(tl.schedule.pp))
    return min(tl.step_time, first_bwd + 2 * (tl.costs.forward + tl.costs.backward))


def first_chunk_window(tl: Timeline) -> float:
    """End of the first chunk's warm-up forwards on every rank: the zoom where lazy and aligned
    differ first (a rank's chunk-0 transposes are due before or inside these forwards)."""
    last = tl.schedule.pp - 1
    return min(i.end for i in tl.of_kind("forward", last)) + tl.costs.forward


def _draw(ax, tl: Timeline, unit: float, window: Optional[float], min_transpose: float = 0.0) -> None:
    pp = tl.schedule.pp
    for kind, (colour, _) in COLOURS.items():
        for rank in range(pp):
            least = min_transpose if kind == "transpose" else 0.0
            bars = [(i.start / unit, max(i.end - i.start, least) / unit)
                    for i in tl.of_kind(kind, rank)]
            if bars:  # thin white edges keep neighbouring ops apart while they are wide
                wide = window is not None or len(tl.of_kind("forward", rank)) <= 64
                ax.broken_barh(bars, (rank - 0.4, 0.8), facecolors=colour,
                               edgecolors="white" if wide and kind in ("forward", "backward")
                               else colour, linewidth=0.4 if wide else 0)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"rank {r}" for r in range(pp)])
    ax.set_ylim(pp - 0.5, -0.5)
    if window is not None:
        ax.set_xlim(0, window / unit)


def plot_plan(lazy: Timeline, aligned: Timeline, path: str, *, full: bool = False) -> None:
    """``plan --plot``: lazy above aligned (the step, or its warm-up when long), each with a zoom
    on the first chunk's forwards beside it; the saving written on the picture; the legend names
    only what is drawn."""
    plt = require_matplotlib()
    from matplotlib.patches import Patch

    unit, pp = 1e-3, lazy.schedule.pp
    window = None
    if not full and warmup_window(lazy) < 0.6 * lazy.step_time:
        window = max(warmup_window(lazy), warmup_window(aligned))
    zoom = max(first_chunk_window(lazy), first_chunk_window(aligned))
    fig, axes = plt.subplots(2, 2, figsize=(15, 2.2 + 1.1 * pp), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1.3]})
    for row, (tl, title) in enumerate(((lazy, "lazy (today)"), (aligned, "aligned (this plugin)"))):
        _draw(axes[row, 0], tl, unit, window)
        if window is None or tl.step_time <= window:
            axes[row, 0].axvline(tl.step_time / unit, color="black", linewidth=1)
        shown = "" if window is None else f" (first {window / unit:.0f} ms shown)"
        axes[row, 0].set_title(f"{title}: step {tl.step_time / unit:.2f} ms{shown}", fontsize=10,
                               loc="left")
        # Transposes are ~1% of a forward: in the zoom they are drawn at least 1% of it wide.
        _draw(axes[row, 1], tl, unit, zoom, min_transpose=0.01 * zoom)
        axes[row, 1].set_title(f"zoom: chunk 0's first forwards ({title.split()[0]}; "
                               "transposes >= 1% wide)", fontsize=9, loc="left")
    for ax in axes[1]:
        ax.set_xlabel("time from step start (ms)")
    saved = lazy.step_time - aligned.step_time
    fig.suptitle(f"aligned saves {saved / unit:.3f} ms per step ({100 * saved / lazy.step_time:.2f}% "
                 f"of lazy's {lazy.step_time / unit:.2f} ms). Lazy ranks > 0 show no all-gather "
                 "wait: their first receive comes after chunk 0's all-gather is complete",
                 fontsize=10)
    kinds = {i.kind for tl in (lazy, aligned) for i in tl.intervals}
    handles: List = [Patch(color=c, label=label) for k, (c, label) in COLOURS.items() if k in kinds]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timelines(timelines: Sequence[Timeline], titles: Sequence[str], path: str,
                   unit: float = 1e-3, unit_name: str = "ms",
                   window: Optional[float] = None) -> None:
    """One panel per timeline, one above the other, on a shared time axis (ranks x time);
    ``window`` (seconds) shows only the step's beginning."""
    plt = require_matplotlib()
    from matplotlib.patches import Patch

    pp = timelines[0].schedule.pp
    fig, axes = plt.subplots(len(timelines), 1, sharex=True,
                             figsize=(12, 1.2 + 0.55 * pp * len(timelines)), squeeze=False)
    for ax, tl, title in zip(axes[:, 0], timelines, titles):
        for kind, (colour, _) in COLOURS.items():
            for rank in range(pp):
                bars = [(i.start / unit, (i.end - i.start) / unit)
                        for i in tl.of_kind(kind, rank)]
                if bars:  # thin white edges keep neighbouring ops apart while they are wide
                    wide = window is not None or len(tl.of_kind("forward", rank)) <= 64
                    ax.broken_barh(bars, (rank - 0.4, 0.8), facecolors=colour,
                                   edgecolors="white" if wide and kind in ("forward", "backward")
                                   else colour, linewidth=0.4 if wide else 0)
        if window is None or tl.step_time <= window:
            ax.axvline(tl.step_time / unit, color="black", linewidth=1)
        ax.set_yticks(range(pp))
        ax.set_yticklabels([f"rank {r}" for r in range(pp)])
        ax.set_ylim(pp - 0.5, -0.5)
        shown = "" if window is None else f" (first {window / unit:.0f} {unit_name} shown)"
        ax.set_title(f"{title}: step {tl.step_time / unit:.2f} {unit_name}{shown}", fontsize=10,
                     loc="left")
        if window is not None:
            ax.set_xlim(0, window / unit)
    axes[-1, 0].set_xlabel(f"time from step start ({unit_name})")
    handles: List = [Patch(color=c, label=label) for c, label in COLOURS.values()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
