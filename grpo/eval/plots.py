"""Plots of evaluation results: pass@k and maj@k curves, and reward over training steps.

DeepSeekMath Fig. 7 in our terms: one panel of pass@k and one of maj@k against k (log2
axis), one line per model, so that "RL raises Maj@K but not Pass@K" can be read off.

matplotlib draws through its Agg canvas directly (a `Figure`, never `pyplot`): no display
is needed and no global backend or figure state is touched. It is imported on use.
"""

from __future__ import annotations

from pathlib import Path

from grpo.errors import UserError

__all__ = ["plot_curves", "plot_rewards"]

_FONT = {"font.size": 11, "axes.titlesize": 13, "axes.labelsize": 12, "legend.fontsize": 10}


def _figure(width: float, height: float):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise UserError("plots need matplotlib: pip install matplotlib") from err
    figure = Figure(figsize=(width, height), dpi=120, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path


def _settings_line(results: dict[str, dict]) -> str | None:
    """'n = 64 samples per prompt, temperature 0.7, 100 prompts' when all results share them."""
    parts = []
    for key, text in (("n", "n = {} samples per prompt"), ("temperature", "temperature {}"), ("prompts", "{} prompts")):
        values = {r.get(key) for r in results.values()}
        if len(values) == 1 and None not in values:
            parts.append(text.format(values.pop()))
    return ", ".join(parts) or None


def plot_curves(results: dict[str, dict], path, *, title: str | None = None) -> Path:
    """One PNG, two panels: pass@k and maj@k against k, one line per named result.

    `results` maps a label ("base", "GRPO", ...) to what `grpo.eval.evaluate` returned (only
    "pass@k", "maj@k" and, when present, their "_ci" intervals, drawn shaded, are read).
    The x axis is log2 with a tick at every k; y runs from 0 to 1. Returns the path.
    """
    if not results:
        raise ValueError("plot_curves needs at least one result")
    import matplotlib

    with matplotlib.rc_context(_FONT):
        figure = _figure(11, 4.6)
        axes = figure.subplots(1, 2, sharey=True)
        all_ks: set[int] = set()
        for metric, ax in zip(("pass@k", "maj@k"), axes):
            for i, (label, result) in enumerate(results.items()):
                if metric not in result:
                    raise ValueError(f"result {label!r} has no {metric!r}")
                ks = sorted(result[metric], key=int)
                x = [int(k) for k in ks]
                y = [result[metric][k] for k in ks]
                color = f"C{i}"
                # Unclipped, above the spines: a curve at 0 or 1 must not hide behind the frame.
                ax.plot(x, y, marker="o", markersize=4, linewidth=2, color=color, label=label, clip_on=False, zorder=3)
                ci = result.get(f"{metric}_ci")
                if ci:
                    ax.fill_between(
                        x, [ci[k][0] for k in ks], [ci[k][1] for k in ks], color=color, alpha=0.18, linewidth=0
                    )
                all_ks.update(x)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1)
            ax.set_title(metric.replace("@k", "@K"))
            ax.set_xlabel("k (samples per prompt)")
            ax.grid(True, which="major", alpha=0.3)
        ticks = sorted(all_ks)
        for ax in axes:
            ax.set_xticks(ticks, [str(k) for k in ticks])
            ax.minorticks_off()
            if len(ticks) == 1:
                ax.set_xlim(ticks[0] / 2, ticks[0] * 2)
        axes[0].set_ylabel("accuracy")
        axes[0].legend(loc="lower right")
        subtitle = _settings_line(results)
        heading = "\n".join(t for t in (title, subtitle and f"{subtitle}; shaded: 95% CI over prompts") if t)
        if heading:
            figure.suptitle(heading)
        return _save(figure, path)


def plot_rewards(
    series: dict[str, list[tuple[int, float]]],
    path,
    *,
    ylabel: str = "mean reward",
    title: str | None = None,
    right: dict[str, list[tuple[int, float]]] | None = None,
    right_label: str = "",
) -> Path:
    """One PNG: a value (the mean reward by default) against the training step, one line per run.

    `series` maps a run's label to its (step, value) points, e.g. read from metrics.jsonl.
    `right`: more series in their own units, dashed, on a second y axis (`right_label`); the
    i-th takes the i-th series' colour (a reward model's score beside the true accuracy).
    Returns the path.
    """
    if not series:
        raise ValueError("plot_rewards needs at least one series")
    import matplotlib

    with matplotlib.rc_context(_FONT):
        figure = _figure(7, 4.4)
        ax = figure.subplots()
        axes = [(ax, series, "-")] + ([(ax.twinx(), right, "--")] if right else [])
        for axis, lines, style in axes:
            for i, (label, points) in enumerate(lines.items()):
                points = sorted(points)
                axis.plot(
                    [s for s, _ in points],
                    [v for _, v in points],
                    linewidth=2,
                    linestyle=style,
                    color=f"C{i}",
                    label=label,
                    marker="o" if len(points) <= 30 else None,
                    markersize=3,
                )
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        handles = [h for axis, _, _ in axes for h in axis.get_legend_handles_labels()[0]]
        ax.legend(handles=handles, loc="best", fontsize=8 if right else None)
        if right:
            axes[1][0].set_ylabel(right_label)
        if title:
            ax.set_title(title)
        return _save(figure, path)
