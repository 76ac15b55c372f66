"""The bench's figures as PNG files (``specjax bench --plots DIR``), drawn with matplotlib.

* ``speedup_vs_batch.png``: each variant's speed-up over autoregressive decoding against the
  batch size, one panel per temperature (static chains solid, adaptive ones dashed).
* ``reliability.png``: the adaptive variants' reliability diagram: in each bin of predicted
  acceptance, the mean prediction against the fraction of those drafts the verifier accepted
  (the diagonal is a perfect calibration), with the expected calibration error in the legend.
"""

from __future__ import annotations

import pathlib


def require():
    """matplotlib, or a clear error naming what to install."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'specjax[plots]' (or matplotlib)"
                         ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def _key(row: dict) -> str:
    return f"{row['method']} {row['label']}"


def write(results: list[dict], folder) -> list[pathlib.Path]:
    """Write the figures of one or more bench results (one per batch size) into ``folder``;
    return their paths. The reliability diagram only when some row has predictions."""
    plt = require()
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [r for result in results for r in result["rows"]]
    temperatures = sorted({r["temperature"] for r in rows})
    paths = []

    fig, axes = plt.subplots(1, len(temperatures), figsize=(5.5 * len(temperatures), 4.2),
                             squeeze=False)
    for ax, t in zip(axes[0], temperatures):
        series: dict[str, list] = {}
        for r in rows:
            if r["temperature"] == t:
                series.setdefault(_key(r), []).append((r.get("batch_size", 1), r["speedup"]))
        for name, points in series.items():
            points.sort()
            adaptive = "adaptive" in name or "budget" in name
            ax.plot([b for b, _ in points], [s for _, s in points], "o--" if adaptive else "o-",
                    label=name)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("speed-up over autoregressive")
        ax.set_title(f"T = {t:g}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(folder / "speedup_vs_batch.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    scored = [r for r in rows if r.get("reliability")]
    if scored:
        fig, ax = plt.subplots(figsize=(5, 5))
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
        for r in scored:
            pred, acc, _ = zip(*r["reliability"])
            ax.plot(pred, acc, "o-", ms=3, label=f"{_key(r)}, T={r['temperature']:g}, batch "
                    f"{r.get('batch_size', 1)} (ECE {r['calibration_error']:.3f})")
        ax.set_xlabel("predicted acceptance")
        ax.set_ylabel("measured acceptance")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=6)
        fig.tight_layout()
        paths.append(folder / "reliability.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
