"""`llmc bench --plot FILE.png`: a grouped bar chart of tokens/s per engine (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from llmc.errors import UsageError
from llmc.runtime.bench import EngineSpeeds
from llmc.textfile import check_writable

INSTALL_HINT = "pip install 'llmc[bench]' (matplotlib)"


def check_plot(path: Path) -> None:
    """Refuse, before any measuring, a `--plot` that cannot be written: no matplotlib, a folder, or a
    file in a folder that does not exist."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"--plot needs matplotlib: {INSTALL_HINT}")
    check_writable("--plot", path, "a .png file")
    if path.suffix.lower() != ".png":
        raise UsageError(f"--plot {path}: the plot is a PNG image; name a .png file")


def plot_bench(path: Path, engines: Sequence[EngineSpeeds], prompts: Sequence[int], depths: Sequence[int],
               decode_tokens: int, where: str, title: str = "") -> None:
    """Two panels: prefill tokens/s per (depth, prompt), decode tokens/s per depth; one bar per engine."""
    check_plot(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefill_tests = [(d, p) for d in depths for p in prompts]
    panels = [
        ("prefill", [f"pp{p}\n@ d{d}" for d, p in prefill_tests], [[e.prefill.get(t, 0.0) for t in prefill_tests]
                                                                   for e in engines]),
        ("decode", [f"tg{decode_tokens}\n@ d{d}" for d in depths], [[e.decode.get(d, 0.0) for d in depths]
                                                                   for e in engines]),
    ]
    bars = (len(prefill_tests) + len(depths)) * len(engines)
    fig, axes = plt.subplots(1, 2, figsize=(min(24.0, max(8.0, 0.45 * bars + 3)), 4.8),
                             gridspec_kw={"width_ratios": [len(prefill_tests), max(1, len(depths))]})
    width = 0.8 / max(1, len(engines))
    for ax, (what, labels, values) in zip(axes, panels):
        for i, (engine, row) in enumerate(zip(engines, values)):
            xs = [x + (i - (len(engines) - 1) / 2) * width for x in range(len(labels))]
            bars = ax.bar(xs, row, width, label=engine.name)
            ax.bar_label(bars, labels=[f"{v:.0f}" if v else "" for v in row], fontsize=7, padding=2)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{what} ({where})")
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.12)
    axes[0].legend(fontsize=8, loc="upper right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png", dpi=120)
    except OSError as e:
        raise UsageError(f"cannot write --plot {path}: {e.strerror or e}") from e
    finally:
        plt.close(fig)
