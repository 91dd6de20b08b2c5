"""``build_data``: config -> tokenizer + training stream + validation set."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from data.blend import StreamingBlend, gpt_config, stack_samples
from data.config import (
    DataConfig,
    DataConfigError,
    check_files_exist,
    expand_prefix,
    to_data_config,
    uses_demo,
    validate_config,
)
from data.demo import ensure_demo_corpus
from data.indexed import mcore, open_indexed, quiet_megatron_logs, read_sidecar
from data.interleave import to_fraction
from data.schedule import PhaseSchedule, Source
from data.tokenizer import MegatronTokenizerAdapter, TokenizerSpec, load_tokenizer_spec

log = logging.getLogger("nvfp4_pretrain")


@dataclass
class DataBundle:
    vocab_size: int
    tokenizer: Any  # tokenizers.Tokenizer
    train: StreamingBlend
    eod_id: int
    config: DataConfig
    seq_length: int
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    demo_dir: Optional[str] = None
    validation_dataset: Any = None  # megatron BlendedDataset, or None
    _val_cache: Dict[int, List[Dict[str, torch.Tensor]]] = field(default_factory=dict, repr=False)

    def validation_batches(self, num_batches: int) -> List[Dict[str, torch.Tensor]]:
        """THIS RANK's share of a fixed validation set: ``num_batches`` micro-batches.

        Global validation micro-step j covers samples [j*M*D, (j+1)*M*D) of megatron's
        ``BlendedDataset`` over all validation prefixes (one epoch each, in proportion to their
        sizes, each shuffled once with the run's seed); rank r takes the r-th M of them. Identical on every call; average the
        loss over DP ranks to get the full-set value. Wraps around (with a warning) when the
        validation set is smaller than num_batches*M*D samples. Empty list without validation data.
        """
        if self.validation_dataset is None or num_batches <= 0:
            return []
        if num_batches not in self._val_cache:
            n = len(self.validation_dataset)
            m, d = self.micro_batch_size, self.dp_size
            need = num_batches * m * d
            if need > n:
                log.warning("validation set has %d samples, %d requested: wrapping around", n, need)
            out = []
            for j in range(num_batches):
                start = j * m * d + self.dp_rank * m
                out.append(stack_samples([self.validation_dataset[(start + t) % n] for t in range(m)]))
            self._val_cache = {num_batches: out}
        return self._val_cache[num_batches]


def _default_barrier() -> Callable[[], None]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.barrier
    return lambda: None


def _global_rank(dp_rank: int) -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return dp_rank


def build_data(
    cfg: Any,
    *,
    seq_length: int,
    micro_batch_size: int,
    global_batch_size: int,
    total_tokens: int,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    show_progress: bool = True,
    barrier: Optional[Callable[[], None]] = None,
) -> DataBundle:
    """Build the data side of a run.

    cfg: DataConfig, or a DictConfig/dict with its keys. ``cfg.total_tokens`` (when set) overrides
    ``total_tokens`` (pass the trainer's max_steps * global_batch * seq).

    Multi-process: call on every rank. Global rank 0 (torch.distributed's rank when it is
    initialized, else ``dp_rank``) prepares the demo corpus if needed while the others wait in
    ``barrier`` (default: torch.distributed.barrier when initialized, else no wait); preparation is
    atomic anyway, so unsynchronised processes are safe too. All other indices (per-epoch training
    indices, validation) are built in memory by each process, deterministically: no shared files.

    Raises DataConfigError (MissingDataError for absent files) with the offending key named.
    """
    cfg = to_data_config(cfg)
    validate_config(cfg)
    demo_dir = _prepare_demo(cfg, dp_rank, show_progress, barrier or _default_barrier())
    check_files_exist(cfg, demo_dir)
    spec = _load_tokenizer(cfg, demo_dir)
    tokenizer = spec.tokenizer
    adapter = MegatronTokenizerAdapter(tokenizer, eod=spec.eod, sha256=spec.sha256)

    total = cfg.total_tokens if cfg.total_tokens is not None else int(total_tokens)
    if total <= 0:
        raise DataConfigError(f"total_tokens = {total}: need a positive number of tokens for the phase schedule")
    sources, indexed = _training_sources(cfg, demo_dir, spec.sha256, seq_length)
    schedule = PhaseSchedule(
        sources, [(p.name, p.end_fraction, dict(p.weights)) for p in cfg.phases], total, seq_length
    )
    for ph in schedule.phases:
        if not ph.interleave.exact:
            log.warning("phase %r: weights rounded to multiples of 1/%d", ph.name, ph.interleave.period)
    train = StreamingBlend(
        sources, indexed, schedule, tokenizer_adapter=adapter, seq_length=seq_length,
        micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, seed=seed,
        dp_rank=dp_rank, dp_size=dp_size,
    )

    val_prefixes = _validation_prefixes(cfg, demo_dir, spec.sha256)
    val = _build_validation(val_prefixes, adapter, seq_length, seed) if val_prefixes else None

    return DataBundle(
        vocab_size=tokenizer.get_vocab_size(), tokenizer=tokenizer, train=train, eod_id=adapter.eod,
        config=cfg, seq_length=seq_length, micro_batch_size=micro_batch_size, dp_rank=dp_rank,
        dp_size=dp_size, demo_dir=demo_dir, validation_dataset=val,
    )


def _prepare_demo(cfg: DataConfig, dp_rank: int, show_progress: bool,
                  barrier: Callable[[], None]) -> Optional[str]:
    """The demo corpus's directory when the config uses it (None otherwise): global rank 0 builds
    it while the others wait in ``barrier``, then they open it."""
    if not uses_demo(cfg):
        return None
    cache_dir = os.path.abspath(os.path.expanduser(cfg.cache_dir))
    rank = _global_rank(dp_rank)
    if rank == 0:
        corpus = ensure_demo_corpus(cache_dir, cfg.demo, show_progress=show_progress)
    barrier()
    if rank != 0:
        corpus = ensure_demo_corpus(cache_dir, cfg.demo, show_progress=False)
    return corpus.path


def _load_tokenizer(cfg: DataConfig, demo_dir: Optional[str]) -> TokenizerSpec:
    """data.tokenizer, or the demo corpus's own when it is unset."""
    tok_path = cfg.tokenizer if cfg.tokenizer is not None else os.path.join(demo_dir, "tokenizer.json")
    try:
        return load_tokenizer_spec(tok_path)
    except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exception
        raise DataConfigError(f"data.tokenizer = {tok_path!r}: cannot load it: {err}") from err


def _training_sources(cfg: DataConfig, demo_dir: Optional[str], tok_sha: str,
                      seq_length: int) -> tuple[List[Source], list]:
    """One Source (and its opened indexed dataset) per training prefix: categories in config
    order, prefixes in order, a glob entry standing for its matches (shards) in natural order."""
    sources, indexed = [], []
    for cat, cc in cfg.categories.items():
        groups = [expand_prefix(f"data.categories.{cat}.prefixes[{j}]", p, demo_dir) for j, p in enumerate(cc.prefixes)]
        entry = [j for j, g in enumerate(groups) for _ in g]
        paths = [p for g in groups for p in g]
        if not paths:
            raise DataConfigError(f"data.categories.{cat}: every prefix is an empty shard (no documents)")
        ds = [open_indexed(p) for p in paths]
        ntok = [int(d.sequence_lengths.sum()) for d in ds]
        if cc.weights is None:
            ws = [Fraction(n) for n in ntok] if all(ntok) else [Fraction(1)] * len(ds)
        else:  # an entry's weight, shared among its matches by token count
            group_tokens = [sum(n for n, e in zip(ntok, entry) if e == j) for j in range(len(groups))]
            ws = [to_fraction(cc.weights[e]) * (Fraction(n, group_tokens[e]) if group_tokens[e] else 1)
                  for n, e in zip(ntok, entry)]
        wsum = sum(ws)
        for j, (p, d, n) in enumerate(zip(paths, ds, ntok)):
            _check_tokenizer_match(p, tok_sha, f"data.categories.{cat}.prefixes[{entry[j]}]")
            src = Source(
                key=f"{cat}/{j}", category=cat, prefix=p, weight_in_category=ws[j] / wsum,
                num_documents=len(d.document_indices) - 1, num_tokens=n,
            )
            src.samples_per_epoch = (n - 1) // seq_length if n > 0 else 0
            sources.append(src)
            indexed.append(d)
    used = {s for ph in cfg.phases for s in ph.weights}
    for src in sources:
        if src.category in used and src.samples_per_epoch <= 0:
            raise DataConfigError(
                f"data.categories.{src.category}: prefix {src.prefix!r} holds {src.num_tokens} tokens, "
                f"fewer than one sample of seq_length {seq_length} + 1"
            )
    return sources, indexed


def _validation_prefixes(cfg: DataConfig, demo_dir: Optional[str], tok_sha: str) -> List[str]:
    """Every validation prefix (globs expanded), each checked against the run's tokenizer."""
    prefixes = []
    for g, ps in cfg.validation.items():
        for j, p in enumerate(ps):
            for path in expand_prefix(f"data.validation.{g}[{j}]", p, demo_dir):
                prefixes.append(path)
                _check_tokenizer_match(path, tok_sha, f"data.validation.{g}[{j}]")
    return prefixes


def _check_tokenizer_match(prefix: str, tok_sha: str, key: str) -> None:
    meta = read_sidecar(prefix)
    if meta and meta.get("tokenizer_sha256") and meta["tokenizer_sha256"] != tok_sha:
        raise DataConfigError(
            f"{key} = {prefix!r} was tokenized with a different tokenizer "
            f"({meta.get('tokenizer', '?')}) than data.tokenizer: re-run data.prepare or fix data.tokenizer"
        )


def _build_validation(prefixes: List[str], adapter, seq_length: int, seed: int):
    """One epoch of each validation prefix (megatron ``GPTDataset``, shuffled with ``seed``),
    blended in proportion to their sizes by megatron's ``BlendedDataset``; indices in memory.

    Not ``BlendedMegatronDatasetBuilder``: in megatron-core 0.16.1 its cached path calls
    ``torch.distributed.get_rank()`` unconditionally (blended_dataset.py:153), so it fails without
    an initialized process group, and without a cache dir it writes index files next to the data.
    """
    m = mcore()
    cfg = gpt_config(seq_length, seed, adapter)
    parts = []
    with quiet_megatron_logs():
        for p in prefixes:
            idx = open_indexed(p)
            docs = np.arange(len(idx.document_indices) - 1, dtype=np.int32)
            ds = m.GPTDataset(idx, p, docs, None, m.Split.valid, cfg)
            if len(ds) == 0:
                log.warning("validation prefix %s holds no complete sample of seq_length %d: skipped", p, seq_length)
                continue
            parts.append(ds)
        if not parts:
            return None
        return m.BlendedDataset(parts, [len(d) for d in parts], None, cfg)
