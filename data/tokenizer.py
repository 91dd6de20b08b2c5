"""Tokenizers: HF ``tokenizers`` byte-level BPE (trained locally, no hub) and the small adapter
megatron-core's GPTDataset wants (it only reads ``eod``/``vocab_size``/``unique_identifiers``)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Iterable, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOD_TOKEN = "<|endoftext|>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, length: Optional[int] = None) -> Tokenizer:
    """Byte-level BPE with ``<|endoftext|>`` as id 0. Deterministic for the same input order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=length)
    return tok


def eod_id(tok: Tokenizer) -> int:
    i = tok.token_to_id(EOD_TOKEN)
    if i is None:
        raise ValueError(f"tokenizer has no end-of-document token {EOD_TOKEN!r}; add it as a special token")
    return i


def load_tokenizer(path: str) -> Tokenizer:
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    tok = Tokenizer.from_file(path)
    eod_id(tok)
    return tok


def save_tokenizer_atomic(tok: Tokenizer, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tokenizer-", suffix=".json.tmp", dir=d)
    os.close(fd)
    try:
        tok.save(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def tokenizer_sha256(tok: Tokenizer) -> str:
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


class MegatronTokenizerAdapter:
    """What megatron-core's GPT datasets read from ``config.tokenizer``: ``eod``, ``vocab_size``
    and ``unique_identifiers`` (hashed into megatron's index-cache names). No pad token: megatron
    then uses -1, which never occurs in the data."""

    def __init__(self, tok: Tokenizer):
        self.tokenizer = tok
        self.eod = eod_id(tok)
        self.eos = self.eod
        self.vocab_size = tok.get_vocab_size()
        self.unique_identifiers = {
            "class": "HFTokenizersBPE",
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "sha256": tokenizer_sha256(tok),
        }

    def tokenize(self, text: str):
        return self.tokenizer.encode(text).ids

    def detokenize(self, ids):
        return self.tokenizer.decode(list(ids))
