"""A run's precision report: one HTML page with PNG figures (what the precision-forensics design
calls `training.report`; the commands over finished runs live in tools/).

    python -m tools.report RUN_DIR [--out DIR] [--stat flush|scale_underflow|scale_overflow]

Reads RUN_DIR/metrics.jsonl (and config.yaml for the title) and writes, into RUN_DIR/report/ or
--out DIR, replacing the whole directory at once (a reader sees the old report or the new one):

- underflow.png, the centrepiece: a layer x step heatmap of the underflow telemetry
  (`underflow/<linear>/<pass>/<operand>/<stat>`, training/precision.py), one row per quantized
  GEMM operand in model order, one column per step that measured it, for the chosen statistic
  (default flush: the fraction of nonzero values that quantize to zero); the other statistics
  get their own heatmap when any of them is nonzero;
- loss.png and grad_norm.png, with each precision decision marked at its step;
- the decisions (events precision_fallback, switch_to_bf16, nonfinite, anomaly, resume, ...) as
  a table, and the replays found under RUN_DIR/replay/.

Nothing else of the run is written. Exit codes (errors.ExitCode): 2 not a run directory or a bad
argument, 8 the report cannot be written.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from atomic_files import writer_tag
from compat import quiet_cpu_fallback_warnings
from errors import ConfigError, ExitCode, ProjectError
from training.metrics import read_metrics
from training.run_reader import RunDirError

STATS = ("flush", "scale_underflow", "scale_overflow")
PASS_ORDER = {"fprop": 0, "dgrad": 1, "wgrad": 2}
OPERAND_ORDER = {"x": 0, "w": 1, "dy": 2}
# Events that change what the GEMMs compute or say why a run stopped, in the decisions table and
# marked on the curves; any other event is listed too, unmarked.
MARKED_EVENTS = ("precision_fallback", "switch_to_bf16", "nonfinite", "anomaly")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tools.report",
                                description="Render a run's precision report (HTML + PNG).")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--out", type=Path, default=None, help="report directory (default RUN_DIR/report)")
    p.add_argument("--stat", choices=STATS, default="flush",
                   help="the heatmap's statistic (default flush)")
    return p.parse_args(argv)


@dataclass
class Heatmap:
    rows: list[str]  # "<linear>/<pass>/<operand>", model order
    steps: list[int]
    values: list[list[float]]  # rows x steps; NaN where a step did not measure that row


def _layer_key(row: tuple[str, str, str]) -> tuple:
    linear, gemm, operand = row
    parts = linear.split(".", 2)
    index = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1
    return (index, parts[2] if len(parts) > 2 else linear, PASS_ORDER.get(gemm, 9),
            OPERAND_ORDER.get(operand, 9))


def underflow_heatmap(records: list[dict], stat: str) -> Heatmap:
    """The `stat` fraction of every (linear, pass, operand) at every step that logged it, from
    the step records' underflow keys (the last record of a step counts: a resumed run logs
    again the steps after its checkpoint)."""
    # deferred: training.precision imports megatron (~3 s), for the telemetry's key format only
    from training.precision import parse_underflow_key

    by_step: dict[int, dict[tuple, float]] = {}
    for record in records:
        found = {}
        for key, value in record.items():
            parsed = parse_underflow_key(key)
            if parsed is not None and parsed[3] == stat:
                found[parsed[:3]] = float(value)
        if found:
            by_step[int(record["step"])] = found
    rows = sorted({row for values in by_step.values() for row in values}, key=_layer_key)
    steps = sorted(by_step)
    values = [[by_step[s].get(row, math.nan) for s in steps] for row in rows]
    return Heatmap(["/".join(r) for r in rows], steps, values)


def _plot_heatmap(heat: Heatmap, stat: str, path: Path, marks: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    data = np.array(heat.values, dtype=float)
    height = max(3.0, 0.18 * len(heat.rows) + 1.5)
    fig, ax = plt.subplots(figsize=(max(6.0, min(16.0, 0.25 * len(heat.steps) + 4)), height))
    image = ax.imshow(np.ma.masked_invalid(data), aspect="auto", interpolation="nearest",
                      cmap="magma", vmin=0.0, vmax=max(1e-6, float(np.nanmax(data))))
    ax.set_yticks(range(len(heat.rows)))
    ax.set_yticklabels(heat.rows, fontsize=6)
    ticks = list(range(len(heat.steps)))
    every = max(1, len(ticks) // 20)
    ax.set_xticks(ticks[::every])
    ax.set_xticklabels([str(s) for s in heat.steps[::every]], fontsize=7)
    ax.set_xlabel("step")
    ax.set_title(f"underflow telemetry: {stat} fraction per GEMM operand")
    for event in marks:  # a decision after step N acts from step N+1: a line after N's column
        after = [i for i, s in enumerate(heat.steps) if s > event["step"]]
        if after:
            ax.axvline(after[0] - 0.5, color="cyan", linewidth=1)
    fig.colorbar(image, ax=ax, label=f"{stat} fraction")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_curve(steps: list[dict], key: str, path: Path, marks: list[dict],
                extra: Optional[str] = None) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(r["step"], r[key]) for r in steps if isinstance(r.get(key), (int, float))]
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(*zip(*points), label=key, linewidth=1.2)
    if extra:
        more = [(r["step"], r[extra]) for r in steps if isinstance(r.get(extra), (int, float))]
        if more:
            ax.plot(*zip(*more), "o-", label=extra, linewidth=1.0, markersize=3)
    for event in marks:  # after its step: the step's own point is the one that triggered it
        ax.axvline(event["step"] + 0.5, color="tab:red", linewidth=0.8, linestyle="--")
    if marks:
        ax.plot([], [], color="tab:red", linestyle="--", label="precision decision / anomaly")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _last_per_step(records: list[dict]) -> list[dict]:
    last = {}
    for record in records:
        last[record["step"]] = record
    return [last[s] for s in sorted(last)]


def _event_row(event: dict) -> str:
    fields = {k: v for k, v in event.items() if k not in ("step", "event")}
    text = ", ".join(f"{k}={v}" for k, v in fields.items())
    return (f"<tr><td>{event['step']}</td><td>{html.escape(str(event['event']))}</td>"
            f"<td>{html.escape(text)}</td></tr>")


def _replays(run_dir: Path) -> list[dict]:
    found = []
    for path in sorted((run_dir / "replay").glob("step-*/replay.json")):
        try:
            found.append({"path": path, **json.loads(path.read_text())})
        except (OSError, ValueError):
            continue
    return found


def _replay_html(replay: dict, run_dir: Path) -> str:
    where = html.escape(str(replay["path"].relative_to(run_dir)))
    if replay.get("in_process"):  # trainer.on_anomaly=replay: bisected in the loop
        verdict = f"bisected in the loop (trainer.on_anomaly): {replay.get('trigger')}"
    else:
        verdict = (f"from {replay.get('checkpoint')}: "
                   + ("bit-identical to the log" if replay.get("bit_identical")
                      else "the run logged no record of this step" if replay.get("logged") is None
                      else f"differs from the log by {replay.get('difference')}"))
    parts = [f"<h3>replay of step {replay['step']} ({where})</h3>",
             f"<p>{html.escape(verdict)}</p>"]
    bisect = replay.get("bisect")
    if bisect:
        parts.append(f"<p>bisect: anomaly {html.escape(str(bisect.get('anomaly')))}; "
                     f"{bisect.get('trials_run')} replays; {html.escape(bisect.get('note') or '')}</p>")
        if bisect.get("ranking"):
            parts.append("<table><tr><th>rank</th><th>module</th><th>passes</th>"
                         "<th>severity alone</th><th>severity without it</th></tr>")
            for row in bisect["ranking"]:
                parts.append(f"<tr><td>{row['rank']}</td><td>{html.escape(row['module'])}</td>"
                             f"<td>{','.join(row['passes'])}</td><td>{row['severity_alone']}</td>"
                             f"<td>{row['severity_without']}</td></tr>")
            parts.append("</table>")
    return "\n".join(parts)


def render(run_dir: Path, out: Path, stat: str) -> dict:
    """Write the report's files into `out` (a fresh directory); returns what it holds."""
    records = read_metrics(run_dir)
    steps = _last_per_step([r for r in records if "event" not in r])
    events = [r for r in records if "event" in r]
    marks = [e for e in events if e["event"] in MARKED_EVENTS]
    figures = {}
    heatmaps = {}
    for name in STATS:
        heat = underflow_heatmap(steps, name)
        if not heat.rows:
            continue
        nonzero = any(v > 0 for row in heat.values for v in row if not math.isnan(v))
        if name == stat or nonzero:
            file = f"underflow_{name}.png" if name != stat else "underflow.png"
            _plot_heatmap(heat, name, out / file, marks)
            figures[name] = file
            heatmaps[name] = heat
    curves = {}
    for key, extra in (("loss", "val_loss"), ("grad_norm", None)):
        if _plot_curve(steps, key, out / f"{key}.png", marks, extra):
            curves[key] = f"{key}.png"
    title = run_dir.resolve().name
    precision = None
    try:
        from omegaconf import OmegaConf

        config = OmegaConf.load(run_dir / "config.yaml")
        title = str(config.get("run", {}).get("name", title))
        precision = config.get("precision", {}).get("name")
    except Exception:  # noqa: BLE001 - the title is a nicety; the metrics are the report
        pass
    last = steps[-1] if steps else {}
    body = [f"<h1>Precision report: {html.escape(title)}</h1>",
            f"<p>{html.escape(str(run_dir))}: {len(steps)} steps logged"
            + (f", precision {html.escape(str(precision))}" if precision else "")
            + (f", last loss {last.get('loss')}" if "loss" in last else "") + "</p>"]
    if stat in figures:
        heat = heatmaps[stat]
        worst = max(((v, r, s) for r, row in zip(heat.rows, heat.values)
                     for s, v in zip(heat.steps, row) if not math.isnan(v)), default=None)
        body.append(f"<h2>Underflow: {stat} fraction, GEMM operand x step</h2>")
        body.append(f'<img src="{figures[stat]}" alt="underflow heatmap">')
        if worst:
            body.append(f"<p>highest: {worst[0]:.4g} at {html.escape(worst[1])}, step {worst[2]}"
                        f" ({len(heat.rows)} operands, {len(heat.steps)} steps measured)</p>")
    else:
        body.append("<h2>Underflow</h2><p>no underflow telemetry in metrics.jsonl (a BF16 run, "
                    "or telemetry off)</p>")
    for name, file in figures.items():
        if name != stat:
            body.append(f"<h3>{name}</h3><img src=\"{file}\" alt=\"{name} heatmap\">")
    for key, file in curves.items():
        body.append(f"<h2>{key}</h2><img src=\"{file}\" alt=\"{key}\">")
    body.append("<h2>Precision decisions and events</h2>")
    if events:
        body.append("<table><tr><th>step</th><th>event</th><th>fields</th></tr>")
        body.extend(_event_row(e) for e in events)
        body.append("</table>")
    else:
        body.append("<p>none</p>")
    replays = _replays(run_dir)
    if replays:
        body.append("<h2>Replays</h2>")
        body.extend(_replay_html(r, run_dir) for r in replays)
    page = ("<!doctype html><html><head><meta charset=\"utf-8\"><title>"
            f"{html.escape(title)} precision report</title><style>"
            "body{font-family:sans-serif;max-width:1100px;margin:auto} img{max-width:100%}"
            "table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ccc;"
            "padding:2px 6px}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
    (out / "index.html").write_text(page, encoding="utf-8")
    return {"figures": {**{f"underflow/{k}": v for k, v in figures.items()}, **curves},
            "events": len(events), "steps": len(steps)}


def write_report(run_dir: Path, out: Path, stat: str) -> dict:
    """render() into a temporary directory beside `out`, then one rename into place (an old
    report is moved aside first and removed after)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.tmp-{writer_tag()}"
    old = out.parent / f".{out.name}.old-{writer_tag()}"
    staging.mkdir()
    try:
        summary = render(run_dir, staging, stat)
        if os.path.lexists(out):
            if os.path.islink(out) or not out.is_dir():
                raise ProjectError(f"--out={out}: exists and is not a report directory",
                                   ExitCode.CONFIG)
            os.replace(out, old)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return summary


def main(argv=None) -> int:
    quiet_cpu_fallback_warnings()  # megatron's import-time notes (training.precision imports it)
    args = parse_args(argv)
    run_dir = args.run_dir.expanduser()
    try:
        if not (run_dir / "metrics.jsonl").is_file():
            raise RunDirError(f"RUN_DIR={run_dir}: no metrics.jsonl (not a run of train.py)")
        out = args.out.expanduser() if args.out is not None else run_dir / "report"
        real, run = Path(os.path.realpath(out)), Path(os.path.realpath(run_dir))
        if real == run or real == run / "checkpoints" or run / "checkpoints" in real.parents:
            raise ConfigError(f"--out={out}: would replace the run directory or its checkpoints")
        try:
            summary = write_report(run_dir, out, args.stat)
        except OSError as exc:
            raise ProjectError(f"--out={out}: {exc.strerror or exc}", ExitCode.UNWRITABLE) from None
    except ProjectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    print(f"wrote {out / 'index.html'}: {summary['steps']} steps, {summary['events']} events, "
          f"figures {', '.join(summary['figures'].values())}")
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
