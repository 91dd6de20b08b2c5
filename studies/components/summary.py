"""The study's results reduced to intervals: one value per captured batch, then a t-interval."""

from __future__ import annotations

import math
import statistics

from .capture import KINDS, kind_of, layer_index
from .measure import ACCUMULATE_NS, REPEAT_NS
from .passes import VARIANTS
from .stats import interval, jackknife


def per_batch(results: dict, metric: str, kinds=None, layers=None) -> list[float]:
    """One value per captured batch: the mean of `metric` over its linears (of `kinds`/`layers`)."""
    out = []
    for b in results["batches"]:
        vals = [m[metric] for n, m in b["linears"].items()
                if (kinds is None or kind_of(n) in kinds)
                and (layers is None or layer_index(n) in layers)
                and metric in m and math.isfinite(m[metric])]
        if vals:
            out.append(statistics.fmean(vals))
    return out


def reduction(results, without: str, with_: str, kinds=None) -> dict:
    """Per batch 1 - mean(with) / mean(without) over its linears: the relative error reduction."""
    a, b = per_batch(results, without, kinds), per_batch(results, with_, kinds)
    return interval([1 - w / wo for wo, w in zip(a, b) if wo > 0])


def model_values(results, key: str) -> list[float]:
    return [r[key] for r in results["model"] if key in r]


def summarize_rht(results: dict, s: dict) -> None:
    """The RHT's Wgrad error, kurtosis and flushed values per kind of linear: into s[...]."""
    groups = {"all": None, **{k: [k] for k in KINDS}}
    s["rht"] = {}
    for g, kinds in groups.items():
        row = {"linears": sum(1 for x in results["linears"] if kinds is None or kind_of(x) in kinds)}
        for sr in ("nearest", "sr"):
            for arm in ("plain", "rht"):
                row[f"{arm}_{sr}"] = interval(per_batch(results, f"wgrad_err/{arm}/{sr}", kinds))
            row[f"reduction_{sr}"] = reduction(results, f"wgrad_err/plain/{sr}",
                                               f"wgrad_err/rht/{sr}", kinds)
        for t in ("x", "dy", "x_rht", "dy_rht"):
            row[f"kurtosis_{t}"] = interval(per_batch(results, f"kurtosis/{t}", kinds))
        for t in ("x", "dy"):
            for arm in ("plain", "rht"):
                row[f"flush_{t}_{arm}"] = interval(per_batch(results, f"flush/{t}/{arm}", kinds))
            row[f"flush_{t}_drop"] = interval(  # percentage points fewer values lost to zero
                [a - b for a, b in zip(per_batch(results, f"flush/{t}/plain", kinds),
                                       per_batch(results, f"flush/{t}/rht", kinds))])
        s["rht"][g] = row


def summarize_rht_tails(results: dict, s: dict) -> None:
    """The RHT's effect on the heaviest- and lightest-tailed quarter of (linear, batch) pairs: into s[...]."""
    # heavy tails: the linear-batch pairs in the top quarter of dY (or x) kurtosis
    pairs = [(max(m["kurtosis/dy"], m["kurtosis/x"]),
              1 - m["wgrad_err/rht/nearest"] / m["wgrad_err/plain/nearest"])
             for b in results["batches"] for m in b["linears"].values()
             if math.isfinite(m["kurtosis/dy"]) and math.isfinite(m["kurtosis/x"])]
    pairs.sort()
    q = max(1, len(pairs) // 4)
    s["rht_tails"] = {"heavy": interval([r for _, r in pairs[-q:]]),
                      "light": interval([r for _, r in pairs[:q]]),
                      "kurtosis_heavy_min": pairs[-q][0] if pairs else None,
                      "kurtosis_light_max": pairs[q - 1][0] if pairs else None,
                      "pairs": len(pairs), "unit": "linear x batch"}


def summarize_sr(results: dict, s: dict) -> None:
    """SR's accumulated and repeated-draw bias against nearest rounding: into s[...]."""
    s["sr"] = {}
    for what in ("total", "operand"):
        for mode in ("nearest", "sr"):
            s["sr"][f"{what}_{mode}"] = {
                N: interval(per_batch(results, f"accum/{what}/{mode}/{N}")) for N in ACCUMULATE_NS}
        s["sr"][f"{what}_advantage"] = {  # nearest's bias - SR's, per batch
            N: interval([a - b for a, b in zip(per_batch(results, f"accum/{what}/nearest/{N}"),
                                               per_batch(results, f"accum/{what}/sr/{N}"))])
            for N in ACCUMULATE_NS}
        # shrink factor from N=1 to N=max, per batch
        last = ACCUMULATE_NS[-1]
        for mode in ("nearest", "sr"):
            s["sr"][f"{what}_{mode}_shrink"] = interval(
                [b / a for a, b in zip(per_batch(results, f"accum/{what}/{mode}/1"),
                                       per_batch(results, f"accum/{what}/{mode}/{last}"))
                 if a > 0])
    # over the batches of a capture point: N = 8, 16, 32, ... sequences (n = capture points)
    s["sr"]["point"] = {}
    for rec in results["point_accum"]:
        for name, by_n in rec["linears"].items():
            for N, metrics in by_n.items():
                for metric, value in metrics.items():
                    s["sr"]["point"].setdefault(metric, {}).setdefault(int(N), {}).setdefault(
                        rec["point"], []).append(value)
    means = {metric: {N: [statistics.fmean(pts[p]) for p in sorted(pts)]
                      for N, pts in sorted(by_n.items())}
             for metric, by_n in s["sr"]["point"].items()}
    s["sr"]["point"] = {metric: {N: interval(v) for N, v in by_n.items()}
                        for metric, by_n in means.items()}
    for what in ("total", "operand"):
        if f"{what}/nearest" in means:
            s["sr"]["point"][f"{what}/advantage"] = {
                N: interval([a - b for a, b in zip(v, means[f"{what}/sr"][N])])
                for N, v in means[f"{what}/nearest"].items()}
    for mode in ("nearest", "sr"):
        s["sr"][f"repeat_{mode}"] = {N: interval(per_batch(results, f"repeat/{mode}/{N}"))
                                     for N in REPEAT_NS}
    s["sr"]["repeat_advantage"] = {
        N: interval([a - b for a, b in zip(per_batch(results, f"repeat/nearest/{N}"),
                                           per_batch(results, f"repeat/sr/{N}"))])
        for N in REPEAT_NS}
    s["sr"]["coherence"] = {N: interval(per_batch(results, f"accum/coherence/{N}"))
                            for N in ACCUMULATE_NS}
    if "sr_steps" in results:
        r = results["sr_steps"]
        s["sr_steps"] = {"sr": interval(r["update_err/sr"]), "nearest": r["update_err/nearest"],
                         "sr_mean_of_k": {k: interval(v) for k, v in
                                          r["update_err/sr_mean_of_k"].items()},
                         "sr_mean_all": jackknife(r["update_err/sr_mean_all"],
                                                  r["update_err/sr_mean_loo"]),
                         "val_gap_sr_mean_update": jackknife(
                             r["val_gap/sr_mean_update"], r["val_gap/sr_mean_update_loo"]),
                         "val_gap_mean_update_minus_nearest": jackknife(
                             r["val_gap/sr_mean_update"] - r["val_gap/nearest"],
                             [v - r["val_gap/nearest"] for v in r["val_gap/sr_mean_update_loo"]]),
                         "mean_all_minus_nearest": jackknife(
                             r["update_err/sr_mean_all"] - r["update_err/nearest"],
                             [v - r["update_err/nearest"] for v in r["update_err/sr_mean_loo"]]),
                         "mean_of_k_minus_nearest": {
                             k: interval([e - r["update_err/nearest"] for e in v])
                             for k, v in r["update_err/sr_mean_of_k"].items()},
                         "sr_minus_nearest": interval([e - r["update_err/nearest"]
                                                       for e in r["update_err/sr"]]),
                         "val_gap_sr": interval(r["val_gap/sr"]),
                         "val_gap_nearest": r["val_gap/nearest"],
                         "val_gap_sr_minus_nearest": interval([v - r["val_gap/nearest"]
                                                               for v in r["val_gap/sr"]])}


def summarize_w2d(results: dict, s: dict) -> None:
    """The weight copies' mismatch and errors, 1x16 against 16x16: into s[...]."""
    groups = {"all": None, **{k: [k] for k in KINDS}}
    s["w2d"] = {}
    for g, kinds in groups.items():
        row = {m: interval(per_batch(results, m, kinds)) for m in
               ("w_mismatch/1d", "w_mismatch/2d", "w_err/fprop_1d", "w_err/dgrad_1d", "w_err/2d",
                "dx_err/1d", "dx_err/2d", "dx_consistency/1d", "dx_consistency/2d")}
        row["consistency_reduction"] = reduction(results, "dx_consistency/1d",
                                                 "dx_consistency/2d", kinds)
        row["dx_reduction"] = reduction(results, "dx_err/1d", "dx_err/2d", kinds)
        row["w_err_increase"] = interval(
            [b / a - 1 for a, b in zip(per_batch(results, "w_err/fprop_1d", kinds),
                                       per_batch(results, "w_err/2d", kinds)) if a > 0])
        s["w2d"][g] = row


def summarize_formats(results: dict, s: dict) -> None:
    """Operand and GEMM errors, NVFP4 against MXFP4, and MXFP8's beside them with the share of
    NVFP4's error it removes (n = 0 where the results predate the MXFP8 measurements): into
    s[...]."""
    s["formats"] = {}
    for metric in ("operand_err/x", "operand_err/w", "operand_err/dy", "y_err", "dx_err",
                   "wgrad_err"):
        s["formats"][metric] = {
            "nvfp4": interval(per_batch(results, f"{metric}/nvfp4")),
            "mxfp4": interval(per_batch(results, f"{metric}/mxfp4")),
            "reduction": reduction(results, f"{metric}/mxfp4", f"{metric}/nvfp4"),
            "mxfp8": interval(per_batch(results, f"{metric}/mxfp8")),
            "mxfp8_reduction": reduction(results, f"{metric}/nvfp4", f"{metric}/mxfp8")}


def summarize_layers(results: dict, s: dict) -> None:
    """Per pattern layer: its GEMMs' errors and the one-layer sensitivity scan: into s[...]."""
    layers = sorted({v["layer"] for v in results["linears"].values()})
    s["layers"] = {}
    for i in layers:
        kinds = sorted({v["kind"] for v in results["linears"].values() if v["layer"] == i})
        s["layers"][i] = {
            "kinds": kinds, "bf16_in_recipe": i in results["recipe_bf16_layers"],
            "y_err": interval(per_batch(results, "y_err/nvfp4", layers=[i])),
            "dx_err": interval(per_batch(results, "dx_err/nvfp4", layers=[i])),
            "wgrad_err": interval(per_batch(results, "wgrad_err/nvfp4", layers=[i])),
            "dloss": interval(model_values(results, f"dloss/layer/{i}")),
            "grad_err": interval(model_values(results, f"grad_err/layer/{i}")),
        }


def summarize_variants(results: dict, s: dict) -> None:
    """Every recipe variant on the model against BF16, and paired against the recipe: into s[...]."""
    # The variants these results measured (a results.json from before a variant was added
    # lacks it; the report lists what was measured).
    measured = [v for v in VARIANTS if model_values(results, f"dloss/{v}")]
    s["variants"] = {v: {"dloss": interval(model_values(results, f"dloss/{v}")),
                         "grad_err": interval(model_values(results, f"grad_err/{v}"))}
                     for v in measured}
    paired = lambda a, b, m: interval([x - y for x, y in zip(model_values(results, f"{m}/{a}"),
                                                           model_values(results, f"{m}/{b}"))])
    s["variant_minus_recipe"] = {v: {"dloss": paired(v, "nvfp4", "dloss"),
                                     "grad_err": paired(v, "nvfp4", "grad_err")}
                                 for v in measured if v != "nvfp4"}
    s["bf16_layers_effect"] = {"dloss": paired("nvfp4_no_bf16_layers", "nvfp4", "dloss"),
                               "grad_err": paired("nvfp4_no_bf16_layers", "nvfp4", "grad_err")}
    s["mxfp4_effect"] = {"dloss": paired("mxfp4", "nvfp4", "dloss"),
                         "grad_err": paired("mxfp4", "nvfp4", "grad_err")}


def summarize(results: dict) -> dict:
    """Every interval the report shows (saved in results.json as "summary")."""
    s: dict = {}
    for part in (summarize_rht, summarize_rht_tails, summarize_sr, summarize_w2d,
                 summarize_formats, summarize_layers, summarize_variants):
        part(results, s)
    s["n_batches"], s["n_model_batches"] = len(results["batches"]), len(results["model"])
    return s
