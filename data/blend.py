"""StreamingBlend: the phased, weighted, resumable training sample stream.

Global order. Global sample i comes from (phase, source, k) = schedule.locate(i), k being how many
samples of that source came before i. Within a source, sample k is read from epoch
e = k // N and position k % N of a megatron-core ``GPTDataset`` built over the source's
``IndexedDataset`` for exactly one epoch (N samples) with seed hash(seed, source, e): every epoch
reshuffles documents and samples, and memory is bounded by the source's size, never by the run.

Data parallelism. Global batch b covers samples [b*G, (b+1)*G). As in megatron's pretraining
sampler, micro-step j of that batch covers [b*G + j*M*D, b*G + (j+1)*M*D) and rank r takes the
r-th run of M samples in it (M = micro batch, D = DP size). The global order never depends on D.

State. Everything follows from the number of samples consumed, so the state is O(sources): the
sample index plus per-source counts/epochs/positions (kept for checking and for reports). On load,
if the stored per-source counts differ from what the schedule gives (the schedule or the data
changed), the difference is kept as an offset so each source continues where it stopped.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from data.indexed import mcore, quiet_megatron_logs
from data.schedule import PhaseSchedule, Source

log = logging.getLogger("nvfp4_pretrain")

STATE_VERSION = 1


def epoch_seed(seed: int, source_key: str, epoch: int) -> int:
    """A 31-bit seed for numpy.RandomState, stable across runs and machines."""
    h = hashlib.sha256(f"{seed}|{source_key}|{epoch}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def gpt_config(seq_length: int, seed: int, tokenizer_adapter, **kw):
    """A GPTDatasetConfig for our sources. ``blend=None`` makes megatron mark it ``mock``, which
    only means "do not write index caches next to the data": the indices are built in memory."""
    m = mcore()
    with quiet_megatron_logs():
        return m.GPTDatasetConfig(
            random_seed=seed,
            sequence_length=seq_length,
            tokenizer=tokenizer_adapter,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            **kw,
        )


def stack_samples(samples: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    return {
        "tokens": torch.stack([s["tokens"] for s in samples]).long(),
        "labels": torch.stack([s["labels"] for s in samples]).long(),
        "loss_mask": torch.stack([s["loss_mask"] for s in samples]).float(),
    }


class StreamingBlend:
    def __init__(
        self,
        sources: Sequence[Source],
        indexed: Sequence,  # megatron IndexedDataset per source
        schedule: PhaseSchedule,
        *,
        tokenizer_adapter,
        seq_length: int,
        micro_batch_size: int,
        global_batch_size: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if global_batch_size % (micro_batch_size * dp_size) != 0:
            raise ValueError(
                f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size "
                f"{micro_batch_size} x dp_size {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
        self.sources = list(sources)
        self.indexed = list(indexed)
        self.schedule = schedule
        self.tokenizer_adapter = tokenizer_adapter
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.seed = int(seed)
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.num_micro_batches = global_batch_size // (micro_batch_size * dp_size)
        self.sample_index = 0  # global samples consumed (all ranks)
        self.offsets = np.zeros(len(self.sources), dtype=np.int64)  # see load_state_dict
        self._epoch_datasets: Dict[int, tuple] = {}  # source -> (epoch, GPTDataset)
        self.categories = schedule.categories
        self._cat_index = np.array([self.categories.index(s.category) for s in self.sources])

    # -- sample access ------------------------------------------------------------------------
    def _dataset(self, s: int, epoch: int):
        cur = self._epoch_datasets.get(s)
        if cur is not None and cur[0] == epoch:
            return cur[1]
        m = mcore()
        src = self.sources[s]
        cfg = gpt_config(self.seq_length, epoch_seed(self.seed, src.key, epoch), self.tokenizer_adapter)
        docs = np.arange(src.num_documents, dtype=np.int32)
        with quiet_megatron_logs():
            ds = m.GPTDataset(self.indexed[s], src.prefix, docs, None, m.Split.train, cfg)
        if len(ds) != src.samples_per_epoch:
            raise RuntimeError(f"source {src.key}: epoch {epoch} has {len(ds)} samples, expected {src.samples_per_epoch}")
        self._epoch_datasets[s] = (epoch, ds)  # drops the previous epoch's indices
        return ds

    def sample(self, i: int) -> Dict[str, torch.Tensor]:
        """Global sample i (tokens, labels, loss_mask of length seq)."""
        _, s, k = self.schedule.locate(i)
        k += int(self.offsets[s])
        n = self.sources[s].samples_per_epoch
        return self._dataset(s, k // n)[k % n]

    def source_of(self, i: int) -> int:
        return self.schedule.locate(i)[1]

    def rank_sample_indices(self, batch: int) -> List[List[int]]:
        """This rank's global sample indices of global batch ``batch``, per micro-batch."""
        g, mb, d = self.global_batch_size, self.micro_batch_size, self.dp_size
        base = batch * g
        return [
            list(range(base + j * mb * d + self.dp_rank * mb, base + j * mb * d + (self.dp_rank + 1) * mb))
            for j in range(self.num_micro_batches)
        ]

    def next_global_batch(self) -> List[Dict[str, torch.Tensor]]:
        """This rank's micro-batches of the next global batch; advances the state for all ranks."""
        if self.sample_index % self.global_batch_size:
            raise RuntimeError("sample index is not at a global batch boundary")
        batch = self.sample_index // self.global_batch_size
        out = [stack_samples([self.sample(i) for i in idx]) for idx in self.rank_sample_indices(batch)]
        self.sample_index += self.global_batch_size
        return out

    # -- state --------------------------------------------------------------------------------
    def _counts(self, i: Optional[int] = None) -> np.ndarray:
        i = self.sample_index if i is None else i
        return self.schedule.counts_at(i) + self.offsets

    def state_dict(self) -> Dict:
        counts = self._counts()
        spe = [s.samples_per_epoch for s in self.sources]
        return {
            "version": STATE_VERSION,
            "sample_index": int(self.sample_index),
            "consumed_tokens": int(self.sample_index) * self.seq_length,
            "seq_length": self.seq_length,
            "seed": self.seed,
            "sources": [s.key for s in self.sources],
            "source_counts": [int(c) for c in counts],
            "source_epochs": [int(c // n) for c, n in zip(counts, spe)],
            "source_positions": [int(c % n) for c, n in zip(counts, spe)],
            "samples_per_epoch": spe,
        }

    def load_state_dict(self, state: Dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unknown data state version {state.get('version')!r}")
        if state["seq_length"] != self.seq_length:
            raise ValueError(f"data state was saved with seq_length {state['seq_length']}, now {self.seq_length}")
        i = int(state["sample_index"])
        if i % self.global_batch_size:
            log.warning("data state sample_index %d is not a multiple of global batch %d", i, self.global_batch_size)
        if state["seed"] != self.seed:
            log.warning("data seed changed from %s to %s: within-source order changes", state["seed"], self.seed)
        self.sample_index = i
        self.offsets = np.zeros(len(self.sources), dtype=np.int64)
        stored = dict(zip(state["sources"], state["source_counts"]))
        expected = self.schedule.counts_at(i)
        changed = []
        for s, src in enumerate(self.sources):
            if src.key in stored and stored[src.key] != int(expected[s]):
                self.offsets[s] = stored[src.key] - int(expected[s])
                changed.append(src.key)
        if changed or list(state["sources"]) != [s.key for s in self.sources]:
            log.warning(
                "data schedule or sources changed since the checkpoint (sources %s): each source "
                "continues from its stored position, the blend follows the new schedule", changed
            )
        self._epoch_datasets.clear()

    # -- observability ------------------------------------------------------------------------
    @property
    def phase(self) -> int:
        return self.schedule.phase_of(self.sample_index)

    def metrics(self) -> Dict[str, float]:
        """Global (all DP ranks) cumulative tokens per category and the current phase; computed
        from the sample index alone, so no communication is needed."""
        counts = self._counts()
        out: Dict[str, float] = {"data/phase": self.schedule.phase_of(max(self.sample_index - 1, 0))}
        for c, cat in enumerate(self.categories):
            sel = self._cat_index == c
            out[f"data/tokens/{cat}"] = int(counts[sel].sum()) * self.seq_length
        for c, cat in enumerate(self.categories):
            sel = np.nonzero(self._cat_index == c)[0]
            spe = sum(self.sources[s].samples_per_epoch for s in sel)
            out[f"data/epochs/{cat}"] = round(float(counts[sel].sum()) / spe, 4) if spe else 0.0
        return out

    def epochs(self) -> Dict[str, float]:
        """Epochs read so far per source (fractional)."""
        counts = self._counts()
        return {s.key: float(c) / s.samples_per_epoch for s, c in zip(self.sources, counts)}

    def describe_schedule(self):
        return self.schedule.describe()
