"""Downstream evaluation with lm-evaluation-harness: which tasks, whether they can run offline,
running them on a `ProjectLM` and turning lm-eval's results into `eval/<task>/<metric>` values.

Used by the trainer (`evaluation.*`, `DownstreamEvaluator`) and by `python -m tools.evaluate`.
Offline by design: the process runs with the Hugging Face libraries in offline mode, and a task
whose dataset is neither local nor in the datasets / hub caches is refused at start-up with one
line naming the task and the dataset (`TaskUnavailable`), before anything is written.

lm-eval itself is imported only inside these functions: training without tasks never loads it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from functools import partial
from pathlib import Path
from typing import Any, Optional

from data.demo import ensure_demo_corpus
from data.tokenizer import load_tokenizer_spec
from errors import ConfigError, ExitCode, MissingError, ProjectError

from .cadence import Every
from .metrics import read_metrics

log = logging.getLogger("nvfp4_pretrain")

# The tasks the repository ships (data/make_eval_tasks.py writes them).
SHIPPED_TASKS = Path(__file__).resolve().parents[1] / "data" / "eval_tasks"
# datasets' packaged builders: their data is files named in the config, never the Hub.
LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas"}
LM_EVAL_HINT = "lm-eval is not installed: pip install -e '.[eval]' (or `make setup`)"


class TaskUnavailable(MissingError):
    """A task whose dataset needs the network and is not cached, or lm-eval is missing (exit 3)."""


class UnknownTask(ConfigError):
    """A name that is no lm-eval task, group or tag, nor a task YAML file (exit 2)."""


class UnreadableTaskData(ProjectError):
    """A task whose documents cannot be read, e.g. a malformed JSON line (exit 7)."""

    code = ExitCode.BAD_INPUT


def go_offline() -> None:
    """The Hugging Face libraries never reach for the network (read when they are imported)."""
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[key] = "1"


def task_manager(tasks: list[str]):
    """lm-eval's TaskManager over the shipped tasks (and, when a name is not one of them or a
    path, lm-eval's own catalogue: indexing it takes seconds)."""
    go_offline()
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise TaskUnavailable(LM_EVAL_HINT) from None
    manager = TaskManager(include_path=str(SHIPPED_TASKS), include_defaults=False)
    if all(t in manager.all_tasks or _is_path(t) for t in tasks):
        return manager
    return TaskManager(include_path=str(SHIPPED_TASKS))


def _is_path(task: str) -> bool:
    return task.endswith((".yaml", ".yml")) and os.path.isfile(os.path.expanduser(task))


def _leaf_configs(name: str, manager, seen: set) -> list[tuple[str, dict]]:
    """(task name, its raw config) of every task a name stands for (a group's, a tag's)."""
    from lm_eval.tasks._index import Kind

    if name in seen:
        return []
    seen.add(name)
    entry = manager.task_index.get(name)
    if entry is None:
        raise UnknownTask(f"evaluation task {name!r}: not an lm-eval task, group or tag, nor "
                              f"a task YAML file (shipped tasks: {', '.join(shipped_tasks())})")
    if entry.kind == Kind.TAG:
        return [leaf for task, e in manager.task_index.items() if name in e.tags
                for leaf in _leaf_configs(task, manager, seen)]
    if entry.kind == Kind.GROUP:
        out = []
        for sub in (entry.cfg or {}).get("task", []):
            if isinstance(sub, dict):
                out.append((sub.get("task", name), {**sub}))
            else:
                out += _leaf_configs(sub, manager, seen)
        return out
    return [(name, dict(entry.cfg or {}))]


def shipped_tasks() -> list[str]:
    return sorted(p.stem for p in SHIPPED_TASKS.glob("*.yaml"))


def _hub_cached(path: str) -> bool:
    """Whether `path` (an org/name dataset) is in the datasets or the hub cache."""
    home = Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser()
    hub = Path(os.environ.get("HF_HUB_CACHE", home / "hub")).expanduser()
    cache = Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser()
    return ((hub / f"datasets--{path.replace('/', '--')}").is_dir()
            or (cache / path.replace("/", "___")).is_dir()
            or (cache / path.replace("/", "___").lower()).is_dir())


def check_offline(tasks: list[str], manager) -> None:
    """Refuse (one line) a task whose dataset is on the Hub and not cached, or that is unknown."""
    from lm_eval.tasks._yaml_loader import load_yaml

    for task in tasks:
        if _is_path(task):  # a group file's tasks are names, looked up in the catalogue
            cfg = load_yaml(Path(task).expanduser(), resolve_func=False)
            leaves = ([(cfg.get("task", task), cfg)] if "group" not in cfg else
                      [leaf for sub in cfg.get("task", []) if isinstance(sub, str)
                       for leaf in _leaf_configs(sub, manager, set())])
        else:
            leaves = _leaf_configs(task, manager, set())
        for name, cfg in leaves:
            path = cfg.get("dataset_path")
            if cfg.get("custom_dataset") is not None or path is None or path in LOCAL_BUILDERS:
                continue
            if os.path.isdir(os.path.expanduser(str(path))) or _hub_cached(str(path)):
                continue
            subset = f" ({cfg['dataset_name']})" if cfg.get("dataset_name") else ""
            raise TaskUnavailable(
                f"evaluation task {name!r} needs the dataset {path!r}{subset} from the Hugging "
                "Face Hub, which is not in this machine's cache and this evaluation runs "
                f"offline; download it once where there is a network (python -c \"import "
                f"datasets; datasets.load_dataset('{path}'"
                + (f", '{cfg['dataset_name']}'" if cfg.get("dataset_name") else "")
                + ")\") and copy the cache here, or use a shipped task: "
                + ", ".join(shipped_tasks()))


def check_documents(tasks: list[str], manager) -> None:
    """Load every task's documents once, at start-up: a file that cannot be read (a malformed
    JSON line) is one line naming the task and the reason here, before anything is written,
    not a traceback at the first evaluation, hours in, and again at every resume. datasets
    caches what it read, so the evaluations load it again cheaply."""
    from datasets.exceptions import DatasetsError

    for task in tasks:
        try:
            with _quiet_lm_eval():
                manager.load([os.path.expanduser(task) if _is_path(task) else task])
        except DatasetsError as exc:
            cause = exc.__cause__ or exc.__context__ or exc
            raise UnreadableTaskData(f"evaluation task {task!r}: its documents cannot be read "
                                     f"({type(cause).__name__}: {cause})") from None


def prepare_tasks(tasks: list[str]):
    """The TaskManager for these tasks, after refusing any that cannot run here offline or
    whose documents cannot be read."""
    manager = task_manager(tasks)
    check_offline(tasks, manager)
    check_documents(tasks, manager)
    return manager


def evaluate(lm, tasks: list[str], manager, *, limit: Optional[int] = None,
             seed: int = 1234, log_samples: bool = False) -> dict[str, Any]:
    """lm-eval's simple_evaluate of `lm` on `tasks` (zero-shot, no bootstrap beyond lm-eval's
    own stderr); its full results dictionary on each node's first process (LOCAL_RANK 0), None
    on the others (lm-eval's rule under torchrun: every process ran every request)."""
    from lm_eval import simple_evaluate

    names = [os.path.expanduser(t) if _is_path(t) else t for t in tasks]
    with _quiet_lm_eval():
        return simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                               log_samples=log_samples, random_seed=seed,
                               numpy_random_seed=seed, torch_random_seed=seed,
                               fewshot_random_seed=seed, bootstrap_iters=100)


def _drop_metadata_hint(record: logging.LogRecord) -> bool:
    # lm-eval warns on every task with a custom_dataset (all the shipped ones) that its own
    # CLI's --metadata could pass kwargs: no use to this project, and one line per task.
    return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


@contextlib.contextmanager
def _quiet_lm_eval():
    """One line per evaluation in the run's log: lm-eval's INFO chatter, its --metadata hint
    and the progress bars of building requests and loading the local JSONL are off meanwhile
    (ProjectLM turns off its own tokenizing bar)."""
    import datasets
    import lm_eval.api.task
    from tqdm import tqdm

    lm_log, task_log = logging.getLogger("lm_eval"), logging.getLogger(lm_eval.api.task.__name__)
    level, bars_were_off = lm_log.level, datasets.is_progress_bar_enabled() is False
    lm_log.setLevel(logging.WARNING)
    task_log.addFilter(_drop_metadata_hint)
    datasets.disable_progress_bars()
    # Task.build_all_requests draws a bar per task with no switch to turn it off.
    build_bar, lm_eval.api.task.tqdm = lm_eval.api.task.tqdm, partial(tqdm, disable=True)
    try:
        yield
    finally:
        lm_eval.api.task.tqdm = build_bar
        if not bars_were_off:
            datasets.enable_progress_bars()
        task_log.removeFilter(_drop_metadata_hint)
        lm_log.setLevel(level)


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """`eval/<task>/<metric>` and `eval/<task>/<metric>_stderr` from lm-eval's results
    (its keys are `<metric>,<filter>`; the filter is dropped when it is lm-eval's `none`)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or not isinstance(value, (int, float)):
                continue  # "alias", "samples", and "N/A" stderr
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{metric}/{filt}"
            out[f"eval/{task}/{name}"] = float(value)
    return out


def summary_line(step: Optional[int], metrics: dict[str, float], seconds: float) -> str:
    """One line per evaluation: every task's scores and the time it took."""
    scores = ", ".join(f"{k[5:]} {v:.4g}" for k, v in metrics.items()
                       if not k.endswith("_stderr"))
    where = f"step {step}: " if step is not None else ""
    return f"eval: {where}{scores} ({seconds:.1f} s)"


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def run_tokenizer(data_cfg):
    """The run's TokenizerSpec: data.tokenizer, or the demo corpus's (built into its cache)."""
    path = data_cfg.tokenizer
    if path is None:
        path = ensure_demo_corpus(os.path.abspath(os.path.expanduser(data_cfg.cache_dir)),
                                  data_cfg.demo).tokenizer_path
    return load_tokenizer_spec(path)


def logged_evaluation(run_dir: Path, step: int) -> bool:
    """Whether metrics.jsonl holds `eval/...` values for `step` since the last restart."""
    if not (Path(run_dir) / "metrics.jsonl").exists():
        return False
    found = False
    for record in read_metrics(run_dir):
        if record.get("event") == "restart":
            found = False
        elif record.get("step") == step and any(k.startswith("eval/") for k in record):
            found = True
    return found


class DownstreamEvaluator:
    """The trainer's downstream evaluation: its cadence, its state and running it.

    An evaluation belongs to the step it follows. When one is due (`due`), the trainer writes
    that step's checkpoint first, with this evaluation marked pending in it (`state_dict`), then
    runs it (`run`). A run killed during the evaluation resumes from that checkpoint and runs the
    pending evaluation before training on (`resume_pending`): no step is trained twice or lost,
    and an evaluation metrics.jsonl already holds is not run again.
    """

    def __init__(self, cfg, due: Every, make_lm, run_dir: Path, is_main: bool):
        """`due`: this component's cadence (evaluation.every, and the last step); `make_lm()`:
        the ProjectLM over the trainer's model (built at the first evaluation)."""
        self.cfg, self.due, self.make_lm = cfg, due, make_lm
        self.run_dir, self.is_main = Path(run_dir), is_main
        self.pending: Optional[int] = None
        self._lm = self._manager = None

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.tasks)

    def begin_if_due(self, step: int) -> bool:
        """Whether an evaluation follows `step` (marks it pending, for the checkpoint)."""
        if self.enabled and self.due(step):
            self.pending = step
            return True
        return False

    def state_dict(self) -> dict:
        return {"pending": self.pending}

    def load_state_dict(self, state: Optional[dict]) -> None:
        self.pending = (state or {}).get("pending")

    def resume_pending(self, ctx, sink) -> None:
        """After a resume: the evaluation the checkpoint's step was owed, unless it was logged."""
        if self.pending is None or not self.enabled:
            self.pending = None
            return
        import torch
        import torch.distributed as dist

        done = torch.tensor(float(self.is_main and logged_evaluation(self.run_dir,
                                                                     self.pending)))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(done, op=dist.ReduceOp.MAX)  # rank 0 reads metrics.jsonl
        if done.item():
            self.pending = None
            return
        log.info(f"eval: running the evaluation of step {self.pending}, which the previous "
                 "process did not finish")
        self.run(self.pending, sink)

    def run(self, step: int, sink) -> dict[str, float]:
        """Evaluate every task; log one line, and `eval/...` into the step's metrics."""
        if self._manager is None:
            self._manager = prepare_tasks(list(self.cfg.tasks))
        if self._lm is None:
            self._lm = self.make_lm()
        results, seconds = timed(evaluate, self._lm, list(self.cfg.tasks), self._manager,
                                 limit=self.cfg.limit)
        if results is None:  # not a node's first process: rank 0 logs the scores
            self.pending = None
            return {}
        metrics = {**flat_metrics(results), "eval/seconds": seconds}
        log.info(summary_line(step, {k: v for k, v in metrics.items() if k != "eval/seconds"},
                              seconds))
        if sink is not None:
            sink.log(step, metrics)
        self.pending = None
        return metrics
