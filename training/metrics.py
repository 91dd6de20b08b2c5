"""Where metrics go: one console line per step, metrics.jsonl, and W&B (rank 0 only); and the
one reader of metrics.jsonl (`read_metrics`) for the tools and tests that look at a run."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Literal, Optional

from errors import ExitCode, ProjectError

from .run_dir import open_run_file

log = logging.getLogger("nvfp4_pretrain")

METRICS_FILE = "metrics.jsonl"


class _RunLogHandler(logging.FileHandler):
    """train.log, opened as every file in run.dir is (training/run_dir.py: never through a link).
    A failed write (disk full) is said once on the console, not as a traceback per record."""

    failed = False

    def _open(self):
        fd = open_run_file(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        return os.fdopen(fd, self.mode, encoding=self.encoding, errors=self.errors)

    def emit(self, record) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            return super().handleError(record)
        self.failed = True
        sys.stderr.write(f"warning: {self.baseFilename} cannot be written "
                         f"({exc.strerror or exc}); the log goes to the console only\n")


def setup_logging(run_dir: Path, is_main: bool) -> None:
    """Console (rank 0) plus an appending train.log in the run directory."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.INFO if is_main else logging.WARNING)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(console)
    if is_main:
        file = _RunLogHandler(run_dir / "train.log", mode="a")
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        root.addHandler(file)
    for noisy in ("megatron", "wandb"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def render(renderable) -> str:
    """A rich table (or any renderable) as plain text for the log."""
    import io

    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=110, force_terminal=False).print(renderable)
    return buffer.getvalue().rstrip()


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "--:--"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def status_line(step: int, max_steps: int, m: dict[str, Any], eta_s: float) -> str:
    width = len(str(max_steps))
    parts = [
        f"step {step:0{width}d}/{max_steps}",
        f"loss {m['loss']:.4f}",
        f"lr {m['lr']:.2e}",
        f"grad-norm {m['grad_norm']:.3f}",
        f"tok/s {m['tokens_per_sec']:,.0f}",
        f"eta {format_duration(eta_s)}",
    ]
    if "val_loss" in m:
        parts.insert(2, f"val {m['val_loss']:.4f}")
    if "data/phase" in m:
        parts.append(f"phase {m['data/phase']}")
    return " | ".join(parts)


def data_line(m: dict[str, Any]) -> str:
    """The data mix so far: phase and tokens per category (printed at each evaluation)."""
    tokens = {k.removeprefix("data/tokens/"): v for k, v in m.items() if k.startswith("data/tokens/")}
    total = sum(tokens.values()) or 1
    parts = [f"{cat} {n / 1e6:.2f}M ({100 * n / total:.0f}%)" for cat, n in tokens.items()]
    return f"data: phase {m.get('data/phase', 0)} | tokens " + ", ".join(parts)


def grad_health_line(m: dict[str, Any], top: int = 3) -> str:
    """The largest per-layer gradient norms and how many layers hold NaN/Inf (grad/... keys)."""
    norms = {k[5:-5]: v for k, v in m.items() if k.startswith("grad/") and k.endswith("/norm")}
    fracs = {k[5:-15]: v for k, v in m.items()
             if k.startswith("grad/") and k.endswith("/nonfinite_frac")}
    largest = sorted(((v, k) for k, v in norms.items() if math.isfinite(v)), reverse=True)[:top]
    bad = [k for k, v in fracs.items() if v > 0]
    parts = []
    if largest:
        parts.append("largest norms " + ", ".join(f"{k} {v:.3g}" for v, k in largest))
    parts.append(f"non-finite in {len(bad)} of {len(fracs)} layers" if bad else "all finite")
    return "grad health: " + " | ".join(parts)


class MetricsSink:
    """metrics.jsonl + W&B. Non-main ranks get a sink that does nothing.

    Each record is one line, appended with one write through `open_run_file` (never through a
    link). A last line without its newline (the writer was killed or the disk filled mid-record)
    is ended when the sink opens the file, so the records appended after it stay readable.
    """

    def __init__(self, run_dir: Path, enabled: bool, wandb_run=None):
        self.enabled = enabled
        self.wandb_run = wandb_run
        self.path = run_dir / METRICS_FILE
        if enabled and os.path.lexists(self.path):
            self._end_a_torn_line()

    def _append(self, data: bytes) -> None:
        fd = open_run_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError as exc:  # name the file: exit 8 names run.dir (training/trainer.py)
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None
        finally:
            os.close(fd)

    def _end_a_torn_line(self) -> None:
        fd = open_run_file(self.path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            tail = os.pread(fd, min(size, 1 << 20), max(0, size - (1 << 20)))
        finally:
            os.close(fd)
        if not tail or tail.endswith(b"\n"):
            return
        torn = tail[tail.rfind(b"\n") + 1:]
        try:
            json.loads(torn)
            what = "a whole record without its newline, kept"
        except ValueError:  # (UnicodeDecodeError too)
            what = "a record cut short, which readers skip"
        self._append(b"\n")
        log.warning(f"{self.path} did not end with a newline (its writer was killed or the disk "
                    f"filled mid-record): ended its last line ({len(torn)} bytes: {what}) before "
                    "appending")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        self._append((json.dumps(record) + "\n").encode())
        if self.wandb_run is not None:
            self.wandb_run.log({wandb_key(k): v for k, v in metrics.items()}, step=step)

    def event(self, step: int, name: str, **fields) -> None:
        log.info(f"event: {name} at step {step} " + " ".join(f"{k}={v}" for k, v in fields.items()))
        self.log(step, {"event": name, **fields})

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


def read_metrics(run_dir: Path, kind: Optional[Literal["step", "event"]] = None) -> list[dict]:
    """The records of run_dir/metrics.jsonl in the order they were written.

    A record is a step's metrics (``{"step", "loss", ...}``) or an event (``{"step", "event",
    ...}``, see MetricsSink.event); ``kind`` keeps only one of the two. A resumed run logs again
    the steps after its checkpoint, so a step can have two records: the later one counts. A line
    that is not JSON (cut short when the writer was killed) is skipped.
    """
    if kind not in (None, "step", "event"):
        raise ValueError(f"kind must be 'step', 'event' or None, not {kind!r}")
    records = []
    for line in (Path(run_dir) / METRICS_FILE).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or ("event" in record) == (kind == "event"):
            records.append(record)
    return records


def wandb_key(key: str) -> str:
    """train/... for training values, val/... for validation; data/, quant/, grad/, eval/ (the
    downstream tasks) keep theirs."""
    if key.startswith(("data/", "quant/", "grad/", "eval/", "event")):
        return key
    if key.startswith("val_"):
        return "val/" + key[4:]
    return "train/" + key


class WandbUnavailable(ProjectError):
    """logger.mode=online and W&B cannot be used (no API key, no answer from the server)."""

    code = ExitCode.WANDB_UNAVAILABLE


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def check_wandb_online() -> None:
    """Fail fast, before the run writes anything: an API key exists and the server accepts it.

    Without a key this returns at once; without a network wandb gives up after ~10 s.
    """
    import inspect

    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    no_prompt = {"prompt": False} if "prompt" in inspect.signature(wandb.login).parameters else {}
    try:
        logged_in = wandb.login(verify=True, **no_prompt)
    except Exception as exc:  # noqa: BLE001 - wandb raises its own errors and plain ones
        raise WandbUnavailable(
            f"logger.mode=online: W&B did not accept the login ({_first_line(exc)}); check the "
            "network and the API key, or use logger.mode=offline and `wandb sync` later") from None
    if not logged_in:
        raise WandbUnavailable(
            "logger.mode=online but no W&B API key is configured: set WANDB_API_KEY or run "
            "`wandb login`, or use logger.mode=offline (no account needed)")


def start_wandb(run_dir: Path, mode: str, project: str, entity: Optional[str], name: str,
                tags: list[str], config: dict, run_id: Optional[str]):
    """An offline-by-default W&B run in run_dir/wandb, resumed under the same id."""
    if mode == "disabled":
        return None
    import wandb

    wandb_dir = run_dir / "wandb"
    wandb_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        return wandb.init(
            project=project, entity=entity, name=name, tags=list(tags), config=config,
            dir=str(run_dir), mode=mode, id=run_id, resume="allow" if run_id else None,
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
    except Exception as exc:  # noqa: BLE001 - CommError, UsageError, timeouts
        raise WandbUnavailable(
            f"logger.mode={mode}: wandb.init failed ({_first_line(exc)}); use "
            "logger.mode=offline (and `wandb sync` later) or logger.mode=disabled") from None
