"""Preemption and Ctrl-C as the trainer acts on them: recorded, then obeyed at a step's end."""

from __future__ import annotations

import logging
import signal
from typing import Optional

from .distributed import ParallelContext, any_rank

log = logging.getLogger("nvfp4_pretrain")


class StopSignal:
    """SIGTERM/SIGUSR1 (preemption) or a first SIGINT (Ctrl-C) recorded, to be acted on at the
    end of the current step; a second SIGINT raises KeyboardInterrupt at once (exit 130).

    Installed first thing in `run()`, so a signal during start-up is not fatal either.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self):
        self.name: Optional[str] = None
        self.interrupted = False  # a SIGINT arrived: the next one stops at once
        self.previous = {sig: signal.signal(sig, self._record) for sig in self.SIGNALS}

    def restore(self) -> None:
        """The handlers from before (for a caller that goes on after `run()`)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _record(self, signum, _frame) -> None:
        if signum == signal.SIGINT:
            if self.interrupted:
                raise KeyboardInterrupt
            self.interrupted = True
        self.name = signal.Signals(signum).name
        log.warning(f"{self.name} received: finishing this step, then checkpointing"
                    + (" (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""))

    @property
    def requested(self) -> bool:
        """Whether this rank was signalled (what each step's loss reduction carries to the
        others: distributed.step_loss_and_stop)."""
        return self.name is not None

    def agreed(self, ctx: ParallelContext) -> bool:
        """Whether any rank was signalled: all ranks must stop at the same step.

        A collective of its own, for the points outside a step (start-up, after a checkpoint or
        an evaluation). Within the loop each step's flag rides in its loss reduction instead
        (Trainer.train_step), so a step adds no host sync for it: a signal that arrives after
        that reduction is acted on at the end of the next step, one step later at most."""
        return any_rank(self.requested, ctx)
