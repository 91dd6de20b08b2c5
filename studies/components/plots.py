"""The study's figures: rht.png, sr.png, weight2d.png, layers.png, formats.png."""

from __future__ import annotations

import math
from pathlib import Path

from .capture import KINDS, kind_of


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def err(ci: dict, scale: float = 100):
    """A bar's height and its error bar (None for n < 2) from an interval."""
    m = ci["mean"] * scale
    return m, ([[m - ci["lo"] * scale], [ci["hi"] * scale - m]] if ci["lo"] is not None else None)


def _save(plt, fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def plot_rht(results: dict, s: dict, out: Path) -> str:
    """The RHT: Wgrad error per kind, and its reduction against the kurtosis of dY along T."""
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
    xs = range(len(KINDS))
    for k, (arm, sr, color) in enumerate((("plain", "nearest", "tab:orange"),
                                          ("rht", "nearest", "tab:blue"),
                                          ("plain", "sr", "tab:red"), ("rht", "sr", "tab:green"))):
        for i, kind in enumerate(KINDS):
            m, e = err(s["rht"][kind][f"{arm}_{sr}"])
            a1.bar(i + (k - 1.5) * 0.2, m, 0.2, yerr=e, color=color, capsize=2,
                   label=f"{'RHT' if arm == 'rht' else 'no RHT'}, dY {sr}" if i == 0 else None)
    a1.set_xticks(list(xs), KINDS, rotation=20, fontsize=8)
    a1.set_ylabel("Wgrad relative error vs FP32 (%)")
    a1.set_title("Wgrad error with / without the 16-point RHT")
    a1.legend(fontsize=8)
    cmap = plt.get_cmap("tab10")
    for i, kind in enumerate(KINDS):
        pts = [(m["kurtosis/dy"], 100 * (1 - m["wgrad_err/rht/nearest"] / m["wgrad_err/plain/nearest"]))
               for b in results["batches"] for n, m in b["linears"].items() if kind_of(n) == kind]
        a2.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, color=cmap(i), label=kind)
    a2.axhline(0, color="0.5", lw=0.8)
    a2.set_xscale("log")
    a2.set_xlabel("kurtosis of dY along T (mean over channels; Gaussian = 3)")
    a2.set_ylabel("Wgrad error reduction by RHT (%, nearest)")
    a2.set_title("RHT gain vs heavy tails (one point per linear and batch)")
    a2.legend(fontsize=7)
    return _save(plt, fig, out, "rht.png")


def plot_sr(results: dict, s: dict, out: Path) -> str:
    """SR: accumulated bias against N, repeated draws, optimizer steps."""
    plt = _pyplot()
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(17, 4.8))
    for what, style in (("total", "-"), ("operand", "--")):
        for mode, color in (("nearest", "tab:orange"), ("sr", "tab:green")):
            cis = s["sr"][f"{what}_{mode}"]
            ns = list(cis)
            a1.errorbar(ns, [100 * cis[n]["mean"] for n in ns],
                        yerr=[[100 * (cis[n]["mean"] - cis[n]["lo"]) for n in ns],
                              [100 * (cis[n]["hi"] - cis[n]["mean"]) for n in ns]]
                        if cis[ns[0]]["lo"] is not None else None,
                        fmt=style + "o", color=color, capsize=3, ms=4,
                        label=f"{'stochastic' if mode == 'sr' else 'nearest'}, "
                              f"{'vs exact' if what == 'total' else 'dY rounding only'}")
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("micro-batches accumulated (one sequence each)")
    a1.set_ylabel("relative bias of the accumulated Wgrad (%)")
    a1.set_title("Wgrad accumulated over N micro-batches")
    a1.legend(fontsize=8)
    for mode, color in (("nearest", "tab:orange"), ("sr", "tab:green")):
        cis = s["sr"][f"repeat_{mode}"]
        ns = list(cis)
        a2.plot(ns, [100 * cis[n]["mean"] for n in ns], "o-", color=color,
                label="stochastic" if mode == "sr" else "nearest")
    ns = list(s["sr"]["repeat_sr"])
    first = s["sr"]["repeat_sr"][ns[0]]["mean"]
    a2.plot(ns, [100 * first / math.sqrt(n) for n in ns], ":", color="0.4", label="1/sqrt(N)")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("draws N of the same micro-batch")
    a2.set_ylabel("||mean of N quantized dY - dY|| / ||dY|| (%)")
    a2.set_title("Rounding bias of the Wgrad dY operand")
    a2.legend(fontsize=8)
    if "sr_steps" in s:
        st = s["sr_steps"]
        ks = sorted(st["sr_mean_of_k"], key=int)
        cis = [st["sr_mean_of_k"][k] for k in ks]
        a3.errorbar([int(k) for k in ks], [100 * c["mean"] for c in cis],
                    yerr=[[100 * (c["mean"] - c["lo"]) if c["lo"] is not None else 0 for c in cis],
                          [100 * (c["hi"] - c["mean"]) if c["lo"] is not None else 0 for c in cis]],
                    fmt="o-", color="tab:green", capsize=3, label="SR: mean update of k runs")
        a3.axhline(100 * st["nearest"], color="tab:orange", label="nearest (deterministic)")
        a3.set_xscale("log", base=2)
        a3.set_xlabel("SR runs averaged (k)")
        a3.set_ylabel("update error vs BF16 (%)")
        a3.set_title(f"{results['sr_steps']['steps']} optimizer steps from one state")
        a3.legend(fontsize=8)
    return _save(plt, fig, out, "sr.png")


def plot_weight2d(results: dict, s: dict, out: Path) -> str:
    """2D weights: the copies' errors and mismatch, and the Dgrad output."""
    plt = _pyplot()
    xs = range(len(KINDS))
    def weight2d_bars(ax, bars):  # four bars per layer kind, one per (metric, label, color)
        for k, (metric, label, color) in enumerate(bars):
            for i, kind in enumerate(KINDS):
                m, e = err(s["w2d"][kind][metric])
                ax.bar(i + (k - 1.5) * 0.2, m, 0.2, yerr=e, color=color, capsize=2,
                       label=label if i == 0 else None)
        ax.set_xticks(list(xs), KINDS, rotation=20, fontsize=8)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
    bars = [("w_mismatch/1d", "Fprop vs Dgrad copy, 1x16", "tab:red"),
            ("w_err/fprop_1d", "Fprop copy 1x16 (along K)", "tab:orange"),
            ("w_err/dgrad_1d", "Dgrad copy 1x16 (along N)", "tab:olive"),
            ("w_err/2d", "16x16 copy (both)", "tab:blue")]
    weight2d_bars(a1, bars)
    a1.set_ylabel("relative to ||W|| (%)")
    a1.set_title("Weight copies: error and Fprop/Dgrad mismatch (16x16: 0)")
    a1.legend(fontsize=8)
    bars = [("dx_consistency/1d", "dX vs dY·W_fprop, 1x16", "tab:red"),
            ("dx_consistency/2d", "dX vs dY·W_fprop, 16x16", "tab:blue"),
            ("dx_err/1d", "dX vs dY·W (exact), 1x16", "tab:orange"),
            ("dx_err/2d", "dX vs dY·W (exact), 16x16", "tab:cyan")]
    weight2d_bars(a2, bars)
    a2.set_ylabel("relative error of dX (%)")
    a2.set_title("Dgrad output: 1x16 vs 16x16 weights (same dY draws)")
    a2.legend(fontsize=8)
    return _save(plt, fig, out, "weight2d.png")


def plot_layers(results: dict, s: dict, out: Path) -> str:
    """Per layer: the sensitivity scan and the GEMMs' quantization error."""
    plt = _pyplot()
    fig, (a1, a3, a2) = plt.subplots(1, 3, figsize=(18, 4.8))
    layers = sorted(s["layers"], key=int)
    for i in layers:
        row = s["layers"][i]
        color = "tab:gray" if row["bf16_in_recipe"] else "tab:purple"
        m, e = err(row["dloss"], 1)
        a1.bar(int(i), m, 0.6, yerr=e, color=color, capsize=3)
        m, e = err(row["grad_err"])
        a3.bar(int(i), m, 0.6, yerr=e, color=color, capsize=3)
        for k, (metric, c) in enumerate((("y_err", "tab:blue"), ("dx_err", "tab:orange"),
                                         ("wgrad_err", "tab:green"))):
            m, e = err(row[metric])
            a2.bar(int(i) + (k - 1) * 0.25, m, 0.25, yerr=e, color=c, capsize=2,
                   label=metric.replace("_err", "").replace("wgrad", "dW").replace("dx", "dX")
                   if i == layers[0] else None)
    a1.axhline(0, color="0.5", lw=0.8)
    a1.set_xticks([int(i) for i in layers],
                  [f"{i}\n{'/'.join(sorted({k.split()[0] for k in s['layers'][i]['kinds']}))}"
                   for i in layers], fontsize=8)
    a1.set_ylabel("loss change when only this layer is NVFP4")
    a1.set_title("Sensitivity scan: loss (grey: BF16 in the recipe)")
    a3.set_xticks(a1.get_xticks(), [t.get_text() for t in a1.get_xticklabels()], fontsize=8)
    a3.set_ylabel("model gradient error vs BF16 (%)")
    a3.set_title("Sensitivity scan: gradient (only this layer NVFP4)")
    a2.set_xticks([int(i) for i in layers], [str(i) for i in layers])
    a2.set_xlabel("pattern layer")
    a2.set_ylabel("relative error of the layer's GEMM outputs (%)")
    a2.set_title("Per-layer quantization error (NVFP4 recipe)")
    a2.legend(fontsize=8)
    return _save(plt, fig, out, "layers.png")


def plot_formats(results: dict, s: dict, out: Path) -> str:
    """NVFP4 against MXFP4, and MXFP8 beside them where measured: operands and GEMM outputs."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    metrics = list(s["formats"])
    formats = [("nvfp4", "tab:blue"), ("mxfp4", "tab:red")]
    if all(s["formats"][m]["mxfp8"]["n"] for m in metrics):
        formats.append(("mxfp8", "tab:green"))
    width = 0.7 / len(formats)
    for k, (fmt, color) in enumerate(formats):
        for i, metric in enumerate(metrics):
            m, e = err(s["formats"][metric][fmt])
            ax.bar(i + (k - (len(formats) - 1) / 2) * width, m, width, yerr=e, color=color,
                   capsize=2, label=fmt.upper() if i == 0 else None)
    ax.set_xticks(range(len(metrics)),
                  ["x", "W", "dY", "Fprop y", "Dgrad dX", "Wgrad dW"])
    ax.set_ylabel("relative error (%)")
    ax.set_title(" vs ".join(f.upper() for f, _ in formats)
                 + ": operands (nearest) and the recipes' GEMM outputs")
    ax.legend()
    return _save(plt, fig, out, "formats.png")


def plots(results: dict, s: dict, out: Path) -> list[str]:
    """Every figure into `out`; their file names."""
    return [plot(results, s, out) for plot in (plot_rht, plot_sr, plot_weight2d, plot_layers,
                                                plot_formats)]
