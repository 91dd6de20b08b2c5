"""Tokenizers: HF ``tokenizers`` byte-level BPE (trained locally, no hub), Hugging Face tokenizer
directories, and the small adapter megatron-core's GPTDataset wants (it only reads
``eod``/``vocab_size``/``unique_identifiers``).

A tokenizer is given as a ``tokenizer.json`` file (its ``<|endoftext|>`` token ends every document)
or as a Hugging Face tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``): there the
configured ``eos_token`` ends every document and ``bos_token`` starts it when ``add_bos_token`` is
true, as ``transformers`` would use them. ``load_tokenizer_spec`` returns both the tokenizer and
those ids.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from atomic_files import write_atomically

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


HF_CONFIG = "tokenizer_config.json"


@dataclass
class TokenizerSpec:
    """A loaded tokenizer and how documents are framed with it."""

    tokenizer: Tokenizer
    path: str  # the tokenizer.json file or the HF directory, as given
    eod: int  # ends every document
    eod_token: str
    bos: Optional[int] = None  # starts every document (HF add_bos_token), else None
    bos_token: Optional[str] = None
    sha256: str = ""
    # What the tokenizer.json post-processor already adds (then we do not add it twice).
    post_adds_bos: bool = False
    post_adds_eos: bool = False

    def frame(self, ids: List[int]) -> List[int]:
        """Token ids of one document, framed: [BOS] ids EOD."""
        if self.bos is not None and not self.post_adds_bos:
            ids = [self.bos] + ids
        if not self.post_adds_eos:
            ids = ids + [self.eod]
        return ids

    def encode_documents(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.frame(e.ids) for e in self.tokenizer.encode_batch(list(texts))]

    def to_init(self) -> tuple:
        """What a worker process needs to rebuild this spec (picklable)."""
        return (self.tokenizer.to_str(), self.path, self.eod, self.eod_token, self.bos, self.bos_token,
                self.sha256, self.post_adds_bos, self.post_adds_eos)

    @classmethod
    def from_init(cls, init: tuple) -> "TokenizerSpec":
        tok_json, *rest = init
        return cls(Tokenizer.from_str(tok_json), *rest)


def _special_content(value) -> Optional[str]:
    """tokenizer_config.json writes a special token as a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str) or not value:
        raise ValueError(f"not a token: {value!r}")
    return value


def load_tokenizer_spec(path: str) -> TokenizerSpec:
    """A ``tokenizer.json`` file, or a Hugging Face tokenizer directory (tokenizer.json +
    tokenizer_config.json). Raises FileNotFoundError / ValueError naming the file and the problem."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        return _load_hf_dir(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    tok = Tokenizer.from_file(path)
    eod = eod_id(tok)
    return _with_post_processing(TokenizerSpec(tok, path, eod, EOD_TOKEN, sha256=tokenizer_sha256(tok)))


def _load_hf_dir(path: str) -> TokenizerSpec:
    tj, tc = os.path.join(path, "tokenizer.json"), os.path.join(path, HF_CONFIG)
    for f in (tj, tc):
        if not os.path.isfile(f):
            raise FileNotFoundError(
                f"{path} is not a Hugging Face tokenizer directory: {os.path.basename(f)} is missing "
                f"(need tokenizer.json and {HF_CONFIG})")
    tok = Tokenizer.from_file(tj)
    with open(tc, encoding="utf-8") as f:
        conf = json.load(f)
    try:
        eos = _special_content(conf.get("eos_token"))
        bos = _special_content(conf.get("bos_token"))
    except ValueError as e:
        raise ValueError(f"{tc}: eos_token/bos_token {e}") from None
    if eos is None:
        raise ValueError(f"{tc} has no eos_token: it is needed to end every document")
    ids = {}
    for name, token in (("eos_token", eos), ("bos_token", bos)):
        if token is not None:
            ids[name] = tok.token_to_id(token)
            if ids[name] is None:
                raise ValueError(f"{tc}: {name} {token!r} is not in the vocabulary of {tj}")
    add_bos = bool(conf.get("add_bos_token", False))
    if add_bos and bos is None:
        raise ValueError(f"{tc}: add_bos_token is true but there is no bos_token")
    framing = {"eos_token": eos, "bos_token": bos if add_bos else None}
    sha = hashlib.sha256((tok.to_str() + json.dumps(framing, sort_keys=True)).encode("utf-8")).hexdigest()
    spec = TokenizerSpec(tok, path, ids["eos_token"], eos, ids.get("bos_token") if add_bos else None,
                         bos if add_bos else None, sha)
    return _with_post_processing(spec)


def _with_post_processing(spec: TokenizerSpec) -> TokenizerSpec:
    """Note whether the tokenizer.json post-processor already puts BOS/EOS around a text (as a
    TemplateProcessing does), so that framing never doubles them."""
    with_special = spec.tokenizer.encode("a").ids
    plain = spec.tokenizer.encode("a", add_special_tokens=False).ids
    if len(with_special) > len(plain):
        spec.post_adds_eos = with_special[-1] == spec.eod and (not plain or plain[-1] != spec.eod)
        if spec.bos is not None:
            spec.post_adds_bos = with_special[0] == spec.bos and (not plain or plain[0] != spec.bos)
    return spec


def save_tokenizer_atomic(tok: Tokenizer, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomically(path, lambda tmp: tok.save(str(tmp)))


def tokenizer_sha256(tok: Tokenizer) -> str:
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


class MegatronTokenizerAdapter:
    """What megatron-core's GPT datasets read from ``config.tokenizer``: ``eod`` (and ``eos``, the
    same id, in their pad-token check), ``vocab_size`` and ``unique_identifiers`` (hashed into
    megatron's index-cache names). No pad token: megatron then uses -1, which never occurs in the
    data."""

    def __init__(self, tok: Tokenizer, eod: Optional[int] = None, sha256: Optional[str] = None):
        self.tokenizer = tok
        self.eod = eod_id(tok) if eod is None else eod
        self.eos = self.eod
        self.vocab_size = tok.get_vocab_size()
        self.unique_identifiers = {
            "class": "HFTokenizersBPE",
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "sha256": sha256 or tokenizer_sha256(tok),
        }
