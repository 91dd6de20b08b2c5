"""The project's exit codes and the errors that carry them: the one place both are defined.

Every command (`train.py`, `data.prepare` and its `--check`, `tools.hf_export`,
`tools.evaluate`, `studies.ablations`, `launch/slurm.sbatch`) exits with one of `ExitCode`.
A refusal the project foresaw is a `ProjectError` (or a subclass) carrying its code: the entry
point prints its one-line message and exits with that code. Any other exception is a bug: it
propagates with its traceback and the process exits 1. The README's "Exit codes" table is this
enum, row by row (tests/test_errors.py checks that).
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    # an unexpected exception (a bug), with its traceback; also Hydra's own refusals (an unknown
    # key, a wrong type, a value outside a choice's values, a missing group option)
    BUG = 1
    CONFIG = 2  # an invalid value or combination of values (the message names the key)
    MISSING = 3  # a data path, tokenizer, checkpoint file or dataset that is not there
    DIVERGED = 4  # NaN/Inf loss with on_nan=stop, or max_consecutive_skips with on_nan=skip
    # run.dir holds a run and run.resume=never, or another process holds the lock of a run
    # directory or of a data.prepare output prefix
    IN_USE = 5
    NO_USABLE_CHECKPOINT = 6  # every checkpoint torn, corrupt or refused (it would run code)
    BAD_INPUT = 7  # data.prepare --strict: an input record that cannot be read
    # an output (run.dir, data.cache_dir, an export, a prepared dataset) cannot be created or
    # written (read-only, no permission, disk full), or a file there is a link or another user's
    UNWRITABLE = 8
    WANDB_UNAVAILABLE = 9  # logger.mode=online without an API key or an answering server
    # a developer check measured what it checks for and found it wrong (model.ssd_check beyond its
    # tolerance, launch/gpu_path_check.py, a failed run of benchmarks.memory)
    CHECK_FAILED = 10
    # a check that cannot run on this machine (no CUDA, no mamba_ssm): it prints "skipped: <why>";
    # launch/gpu_check.sh reports the part skipped, not failed (77: automake's skip status)
    SKIPPED = 77
    PREEMPTED = 75  # SIGTERM/SIGUSR1/first SIGINT: checkpointed, resumable (EX_TEMPFAIL)
    INTERRUPTED = 130  # a second SIGINT (Ctrl-C), or data.prepare's first: stopped at once
    TERMINATED = 143  # data.prepare on SIGTERM: stopped, its partial output removed


class ProjectError(Exception):
    """A refusal the project foresaw: one line for the user, and the exit code that goes with it."""

    code: ExitCode = ExitCode.CONFIG

    def __init__(self, message: str, code: ExitCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = ExitCode(code)


class ConfigError(ProjectError, ValueError):
    """An invalid config value or combination (exit 2). A ValueError too, so the schema's own
    checks read as Python's convention for a bad value."""

    code = ExitCode.CONFIG


class MissingError(ProjectError):
    """A file or dataset the command needs is not there (exit 3)."""

    code = ExitCode.MISSING
