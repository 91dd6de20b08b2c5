"""The input amax of every low-precision linear: a running maximum over the last N optimizer steps.

A W4A4 serving engine quantizes each linear's input with one *static* per-tensor global scale
(compressed-tensors' `input_global_scale`, ModelOpt's `input_scale`), where training computed the
tensor scale of every activation from its own amax (TE's current scaling). The amax the training
saw over its last N steps is the calibration that needs no extra data: `tools/hf_export.py
--weights nvfp4` turns it into each format's scale.

How it is recorded, without a host sync:
- each emulated linear (parallel_linear.py), handed a 0-d FP32 device tensor of the recorder's
  (`record_input_amax`, nvfp4_recipe/linear_protocol.py), folds `max |x|` of every GEMM input
  into it (training and evaluation forwards; a NaN/Inf amax counts as 0, so a skipped step does
  not poison the window): the tensor amax NVFP4's quantizer computes for the Fprop operand
  anyway, else (MXFP4, FP8 block, BF16 after the switch: their block scales are not max |x|
  exactly) one aminmax pass; a recompute's rerun of the forward, inside the backward, records
  nothing (nvfp4_recipe/linear.py, fold_input_amax);
- `end_step` (the precision controller's `after_step`, training/precision.py) moves those into one row of a (N, linears) ring on
  the device and zeroes them;
- `all_reduce` (the trainer, before each checkpoint) takes the MAX over every rank, so the table
  holds every pipeline stage's linears, the full input of row-parallel linears (each tensor-
  parallel rank sees a K-slice) and every data-parallel rank's batches; then `state_dict` goes
  into trainer.pt and `load_state_dict` restores it on resume (a checkpoint without it starts an
  empty window).
Linears built from TE's layer spec (GPU runs) cannot record (their `record_input_amax` says
False) and are not recorded: `recorded` says which were.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from nvfp4_recipe.linear_protocol import HeldLinear


class InputAmaxRecorder:
    """The running input amax of a model's low-precision linears (see the module docstring).

    `names`: every low-precision linear of the whole model, `layers.<pattern index>.<module>`
    (the precision policy's names, the same list on every rank); `linears`: those this rank
    holds (the model builder's list; the ones not named in `names`, BF16 ones, are left alone),
    each recording if it can."""

    def __init__(self, names: list[str], linears: Sequence[HeldLinear], window: int,
                 device: torch.device | str = "cpu"):
        if window < 0:
            raise ValueError(f"input amax window={window} must be >= 0 (0 = off)")
        self.names = list(names)
        self.window = window
        self.steps = 0  # rows written in total; the next goes to steps % window
        columns = {n: i for i, n in enumerate(self.names)}
        self._amaxes: list[torch.Tensor] = []  # what the linears fold into, one per column below
        recording = []
        for held in linears if window else ():
            if held.name in columns:
                amax = torch.zeros((), dtype=torch.float32, device=device)
                if held.linear.record_input_amax(amax):
                    self._amaxes.append(amax)
                    recording.append(columns[held.name])
        self._columns = torch.tensor(recording, dtype=torch.long, device=device)
        self.history = torch.zeros(max(window, 1), len(self.names), dtype=torch.float32,
                                   device=device)
        self.recorded = torch.zeros(len(self.names), dtype=torch.float32, device=device)
        self.recorded[self._columns] = 1.0

    def end_step(self) -> None:
        """One optimizer step done: its amaxes become the newest row of the window."""
        if not self.window:
            return
        row = self.history[self.steps % self.window]
        row.zero_()
        if self._amaxes:
            row.index_copy_(0, self._columns, torch.stack(self._amaxes))
            torch._foreach_zero_(self._amaxes)
        self.steps += 1

    def all_reduce(self, group=None) -> None:
        """MAX over the ranks of `group` (collective: every rank calls it at the same point)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
            return
        both = torch.cat([self.history, self.recorded.unsqueeze(0)])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        self.history.copy_(both[:-1])
        self.recorded.copy_(both[-1])

    def state_dict(self) -> dict:
        return {"names": list(self.names), "window": self.window, "steps": self.steps,
                "history": self.history.detach().cpu().clone(),
                "recorded": self.recorded.detach().cpu().clone()}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a saved window, matched by linear name (a name not saved starts empty); a
        longer saved window keeps its newest rows."""
        if not self.window:
            return
        rows = _rows_oldest_first(state)[-self.window:]
        self.history.zero_()
        self.recorded.zero_()
        self.recorded[self._columns] = 1.0
        saved = {n: i for i, n in enumerate(state["names"])}
        for column, name in enumerate(self.names):
            if name in saved:
                self.history[: len(rows), column] = rows[:, saved[name]].to(self.history.device)
                if state["recorded"][saved[name]] > 0:
                    self.recorded[column] = 1.0
        self.steps = len(rows)


def _rows_oldest_first(state: Mapping) -> torch.Tensor:
    window, steps, history = int(state["window"]), int(state["steps"]), state["history"]
    if window == 0 or steps == 0:
        return history[:0]
    filled = min(steps, window)
    order = [(steps - filled + j) % window for j in range(filled)]
    return history[order]


def running_input_amax(state: Optional[Mapping]) -> tuple[dict[str, float], int]:
    """({linear name: max input amax over the saved window} for the recorded linears, the number
    of steps in the window) from a recorder's `state_dict` (None: a checkpoint without one)."""
    if not state:
        return {}, 0
    rows = _rows_oldest_first(state)
    if not len(rows):
        return {}, 0
    top = rows.amax(dim=0)
    return ({n: float(top[i]) for i, n in enumerate(state["names"]) if state["recorded"][i] > 0},
            len(rows))
