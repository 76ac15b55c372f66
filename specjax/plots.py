"""The bench's figures as PNG files (``specjax bench --plot DIR``), drawn with matplotlib.

* ``speedup_vs_gamma.png``: each method's speed-up over autoregressive decoding against the
  number of drafts a round verifies (γ for chains; trees at their depth, as single points), one
  panel per temperature, one line per method (and batch size when there are several).
* ``acceptance_per_position.png``: for each variant, the fraction of rounds whose k-th draft was
  accepted, against k, one panel per temperature.
* ``tpot.png``: the distribution of TPOT (decode ms per token, one value per generate call over
  every prompt group and repeat) of autoregressive decoding and of each variant, as box plots
  (whiskers at the 5th and 95th percentiles), one panel per temperature.
* ``speedup_vs_batch.png``: each variant's speed-up over autoregressive decoding against the
  batch size, one panel per temperature (static chains solid, adaptive ones dashed).
* ``reliability.png``: the adaptive variants' reliability diagram: in each bin of predicted
  acceptance, the mean prediction against the fraction of those drafts the verifier accepted
  (the diagonal is a perfect calibration), with the expected calibration error in the legend.
"""

from __future__ import annotations

import pathlib
import re


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


def _static(row: dict) -> bool:
    """A row of fixed shape: no adaptive lengths, no verify budget, no synthetic acceptance."""
    return (row.get("survival_threshold") is None and row.get("verify_costs") is None
            and row.get("synthetic_acceptance") is None)


def speedup_by_gamma(rows: list[dict]) -> dict[float, dict[str, list[tuple[int, float]]]]:
    """temperature -> series name -> [(drafts verified, speed-up)], sorted: static chains of a
    variant (a method with its other settings) form one series; each tree is a series of one
    point at its depth."""
    batches = {r.get("batch_size", 1) for r in rows}
    out: dict[float, dict[str, list]] = {}
    for r in rows:
        if not _static(r):
            continue
        # a chain's label less its γ (lookahead: less its N = γ + 1): variants that differ
        # otherwise (suffix's own-spec factor, n-gram's lookup range) stay apart
        if r.get("tree") is None:
            rest = re.sub(r"^(W\d+) N\d+", r"\1", re.sub(r"^chain \d+", "", r["label"])).strip()
            name = f"{r['method']} {rest}".strip()
        else:
            name = _key(r)
        if len(batches) > 1:
            name += f" (batch {r.get('batch_size', 1)})"
        out.setdefault(r["temperature"], {}).setdefault(name, []).append(
            (r["depth"], r["speedup"]))
    for series in out.values():
        for points in series.values():
            points.sort()
    return out


def tpot_samples(rows: list[dict]) -> dict[float, dict[str, list[float]]]:
    """temperature -> name -> TPOT values in ms (one per generate call): autoregressive first
    (once per temperature and batch size), then each variant."""
    batches = {r.get("batch_size", 1) for r in rows}
    out: dict[float, dict[str, list]] = {}
    for r in rows:
        samples = r.get("tpot_samples_ms")
        if not samples:
            continue
        suffix = f" (batch {r.get('batch_size', 1)})" if len(batches) > 1 else ""
        panel = out.setdefault(r["temperature"], {})
        panel.setdefault("autoregressive" + suffix, samples["ar"])
        panel[_key(r) + suffix] = samples["spec"]
    return out


def _panels(plt, count: int, width: float = 5.5, height: float = 4.2):
    fig, axes = plt.subplots(1, count, figsize=(width * count, height), squeeze=False)
    return fig, axes[0]


def _save(plt, fig, path: pathlib.Path, paths: list) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)


def write(results: list[dict], folder) -> list[pathlib.Path]:
    """Write the figures of one or more bench results (one per batch size) into ``folder``;
    return their paths. The reliability diagram only when some row has predictions, the TPOT
    distributions only when the rows carry their samples."""
    plt = require()
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [r for result in results for r in result["rows"]]
    temperatures = sorted({r["temperature"] for r in rows})
    paths: list[pathlib.Path] = []

    by_gamma = speedup_by_gamma(rows)
    if by_gamma:
        fig, axes = _panels(plt, len(by_gamma))
        for ax, (t, series) in zip(axes, sorted(by_gamma.items())):
            for name, points in series.items():
                ax.plot([g for g, _ in points], [s for _, s in points],
                        "o-" if len(points) > 1 else "s", label=name)
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.set_xlabel("drafts verified a round (γ; a tree's depth)")
            ax.set_ylabel("speed-up over autoregressive")
            ax.set_title(f"T = {t:g}")
            ax.legend(fontsize=7)
        _save(plt, fig, folder / "speedup_vs_gamma.png", paths)

    fig, axes = _panels(plt, len(temperatures))
    for ax, t in zip(axes, temperatures):
        for r in rows:
            accepted = r.get("per_position_acceptance") or []
            if r["temperature"] == t and accepted:
                ax.plot(range(1, len(accepted) + 1), accepted, "o-", ms=3,
                        label=_key(r) + (f" (batch {r['batch_size']})"
                                         if len(results) > 1 else ""))
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("rounds whose k-th draft was accepted")
        ax.set_title(f"T = {t:g}")
        ax.legend(fontsize=6)
    _save(plt, fig, folder / "acceptance_per_position.png", paths)

    tpot = tpot_samples(rows)
    if tpot:
        fig, axes = _panels(plt, len(tpot), width=max(5.5, 0.9 * max(map(len, tpot.values()))))
        for ax, (t, samples) in zip(axes, sorted(tpot.items())):
            ax.boxplot(list(samples.values()), whis=(5, 95), showfliers=True)
            ax.set_xticks(range(1, len(samples) + 1), list(samples), rotation=30, ha="right",
                          fontsize=7)
            ax.set_ylabel("TPOT, ms (per call)")
            ax.set_title(f"T = {t:g}")
        _save(plt, fig, folder / "tpot.png", paths)

    # against the batch size only when the bench ran more than one
    panels = temperatures if len({r.get("batch_size", 1) for r in rows}) > 1 else []
    fig, axes = _panels(plt, len(panels)) if panels else (None, [])
    for ax, t in zip(axes, panels):
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
    if fig is not None:
        _save(plt, fig, folder / "speedup_vs_batch.png", paths)

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
        _save(plt, fig, folder / "reliability.png", paths)
    return paths
