"""The component study's report: README.md (studies/templates/components*.md.j2 filled with the
summary), the figures and results.json, from which --report-only rebuilds the same report."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from studies.render import render

from .measure import ACCUMULATE_NS, REPEAT_NS
from .plots import plots
from .stats import excludes_zero, negated
from .summary import summarize


def pct(ci: dict, scale: float = 100, spec: str = "+.1f", unit: str = " %") -> str:
    """'+12.3 % [+10.1, +14.5]' (95 % t-interval), or the mean alone for n < 2."""
    if ci is None or ci.get("mean") is None:
        return "—"
    if ci["lo"] is None:
        return f"{format(ci['mean'] * scale, spec)}{unit} (n = 1)"
    return (f"{format(ci['mean'] * scale, spec)}{unit} "
            f"[{format(ci['lo'] * scale, spec)}, {format(ci['hi'] * scale, spec)}]")


def num(ci: dict, spec: str = ".4f") -> str:
    return pct(ci, 1, spec, "")


def mark(ci: dict) -> str:
    return "yes" if excludes_zero(ci) else "**no**"


def tokens_per_batch(config: dict) -> int:
    """Tokens of one captured batch: sequences x sequence length, from the run's overrides (a
    results.json of an older study has no "tokens_per_batch")."""
    if "tokens_per_batch" in config:
        return config["tokens_per_batch"]
    value = {}
    for override in config["overrides"]:
        match = re.fullmatch(r"trainer\.(seq_length|global_batch_size)=(\d+)", override)
        if match:
            value[match[1]] = int(match[2])
    return value["seq_length"] * value["global_batch_size"]


def report_data(res: dict, s: dict) -> dict:
    """What the templates show beyond `res` and `s`: the orderings and picks the prose names."""
    sr, last = s["sr"], ACCUMULATE_NS[-1]
    # the largest N measured: over a capture point's batches when there are several
    big = max(sr["point"].get("total/nearest", {last: None}))
    layers = s["layers"]
    resolved = [int(i) for i in layers if excludes_zero(layers[i]["dloss"])]
    checks = res["reference_check"]
    point = sr.get("point", {})
    return {
        "c": res["config"], "mach": res["machine"], "ph": res["phases"],
        "nb": s["n_batches"], "nm": s["n_model_batches"], "tokens": tokens_per_batch(res["config"]),
        "r_all": s["rht"]["all"], "tails": s["rht_tails"], "sr": sr, "w": s["w2d"]["all"],
        "f": s["formats"], "st": s.get("sr_steps"), "last": last, "big": big,
        "accumulate_ns": ACCUMULATE_NS, "repeat_ns": REPEAT_NS,
        "adv_big": point["total/advantage"][big] if big > last else sr["total_advantage"][last],
        "point_rows": [(N, {m: point[m][N] for m in point})
                       for N in sorted(point.get("total/nearest", {})) if N > last],
        "by_loss": sorted(layers, key=lambda i: -(layers[i]["dloss"]["mean"] or 0)),
        "by_grad": sorted(layers, key=lambda i: -(layers[i]["grad_err"]["mean"] or 0)),
        "bf16": [int(i) for i in res["recipe_bf16_layers"]], "resolved": resolved,
        "median_abs_dloss": statistics.median(abs(layers[i]["dloss"]["mean"] or 0) for i in layers),
        "grad_resolved": sum(excludes_zero(layers[i]["grad_err"]) for i in layers),
        "variants_by_grad": sorted(s["variants"], key=lambda k: s["variants"][k]["grad_err"]["mean"]),
        "checks": checks, "worst": max((r["max_abs_diff"] for r in checks), default=None),
    }


def render_readme(res: dict, s: dict) -> str:
    return render("components.md.j2", filters={"pct": pct, "num": num, "mark": mark},
                  res=res, s=s, excludes_zero=excludes_zero, negated=negated,
                  **report_data(res, s))


def write_report(results: dict, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    s = summarize(results)
    plots(results, s, out)
    # Per linear and batch a list of values in the order of "metric_names": ~20k numbers.
    names = sorted({k for b in results["batches"] for m in b["linears"].values() for k in m})
    stored = {**results, "metric_names": names, "batches": [
        {**{k: v for k, v in b.items() if k != "linears"},
         "linears": {n: [m.get(k) for k in names] for n, m in b["linears"].items()}}
        for b in results["batches"]]}
    (out / "results.json").write_text(json.dumps({"summary": s, **stored}, separators=(",", ":"),
                                                 default=str) + "\n")
    (out / "README.md").write_text(render_readme(results, s))
    return s


def read_results(out: Path) -> dict:
    """<out>/results.json as run_study returned it: per-linear value lists back to dicts."""
    results = json.loads((out / "results.json").read_text())
    results.pop("summary", None)
    results["recipe_bf16_layers"] = [int(i) for i in results["recipe_bf16_layers"]]
    names = results.pop("metric_names")
    for b in results["batches"]:
        b["linears"] = {n: {k: v for k, v in zip(names, values) if v is not None}
                        for n, values in b["linears"].items()}
    return results
