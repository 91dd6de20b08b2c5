"""lm-evaluation-harness's `LM` over the project's own model, as training builds it.

`ProjectLM` answers lm-eval's three request types — `loglikelihood`, `loglikelihood_rolling` and
`generate_until` (greedy) — with the run's tokenizer, in batches, through the same schedule
`run_micro_batches` uses (megatron's forward-only schedule on CUDA, its CPU twin elsewhere,
training/schedules.py:run_schedule), so whatever precision, spec and TP/PP layout the model was
built with is what gets scored. The forward step hands megatron's loss contract a loss function
whose report carries, per token, the log-probability of the next token and whether it was the
greedy choice; with several pipeline stages the last stage broadcasts them to every rank, and
every rank of the model-parallel group sees every request (data-parallel ranks repeat the work).

lm-eval is imported here only, and this module is imported only when an evaluation runs.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from .distributed import ParallelContext
from .schedules import REPORT_KEY, run_schedule, to_device

# Every batch is padded to a multiple of this many positions: NVFP4 quantizes whole 16-element
# blocks, and one length per multiple keeps the number of distinct shapes small.
PAD_MULTIPLE = 64


def _score_loss(labels: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int,
                logits: torch.Tensor):
    """megatron's 3-tuple contract; the report holds each position's log-probability of its
    label and the greedy (argmax) token, over the real vocabulary: the rows megatron pads the
    output layer with (to a multiple of 128 x TP) are ids no text encodes to, and the HF export
    strips them, so they take no probability here either."""
    from megatron.core import parallel_state as ps

    width = ps.get_tensor_model_parallel_world_size()
    if width > 1:  # the output layer's vocabulary shards, in rank order
        # dist.all_gather rather than megatron's gather_from_tensor_model_parallel_region, which
        # allocates its output on CUDA; this runs under no_grad and needs no autograd.
        shards = [torch.empty_like(logits) for _ in range(width)]
        dist.all_gather(shards, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(shards, dim=-1)
    logp = torch.log_softmax(logits[..., :vocab_size].float(), dim=-1)
    target = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    mask = loss_mask.float()
    total = -(target * mask).sum()
    return total, mask.sum().to(torch.int), {
        REPORT_KEY: torch.stack([total.detach(), mask.sum()]),
        "logprob": target.detach(), "argmax": logp.argmax(-1)}


def make_score_step(ctx: ParallelContext, vocab_size: int) -> Callable:
    """megatron's `forward_step_func`: the model without labels (its logits), scored above."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(to_device(batch["tokens"], ctx.device), None, None)
        return output, partial(_score_loss, to_device(batch["labels"], ctx.device),
                               to_device(batch["loss_mask"], ctx.device), vocab_size)

    return forward_step


class ProjectLM(TemplateLM):
    """lm-eval's model interface over a megatron model of this project.

    `model`: the (possibly DDP-wrapped) megatron module of this rank; `tokenizer`: the run's
    `data.tokenizer.TokenizerSpec`; `hidden_size`: what flows between pipeline stages;
    `max_length`: the longest input (longer ones keep their last tokens, as lm-eval's HFLM does);
    `vocab_size`: the real vocabulary (`model.vocab_size`, or None: the tokenizer's), without
    megatron's padding rows; `before`: called before each batch of forwards (the precision
    controller's refresh)."""

    def __init__(self, model: torch.nn.Module, tokenizer, ctx: ParallelContext, *,
                 hidden_size: int, max_length: int, batch_size: int = 8, gemm=None,
                 max_gen_toks: int = 64, pad_multiple: int = PAD_MULTIPLE,
                 vocab_size: Optional[int] = None,
                 before: Optional[Callable[[], None]] = None):
        super().__init__()
        self.model, self.tok, self.ctx = model, tokenizer, ctx
        self.vocab_size = vocab_size or tokenizer.tokenizer.get_vocab_size()
        self.hidden_size, self._max_length = hidden_size, max_length
        self.batch_size, self.gemm, self.max_gen_toks = batch_size, gemm, max_gen_toks
        self.pad_multiple = pad_multiple
        self.before = before

    # -- tokenizer --------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eod

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is conditioned on: BOS if the tokenizer has one, else the
        end-of-document token that separates training documents (HFLM's rule)."""
        return self.tok.bos if self.tok.bos is not None else self.tok.eod

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, **kwargs) -> list[int]:
        return self.tok.tokenizer.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.tokenizer.decode(tokens, skip_special_tokens=False)

    # -- the forward ------------------------------------------------------------------------
    @torch.no_grad()
    def _forward(self, rows: list[list[int]], targets: list[list[int]]):
        """Per row, per input position: log p(target) and the argmax token. Rows are right-padded
        (causal: padding never changes the positions before it) to one length."""
        from megatron.core import parallel_state as ps
        from megatron.core.utils import get_model_config

        longest = max(len(r) for r in rows)
        multiple = self.pad_multiple
        if get_model_config(self.model).sequence_parallel:
            multiple *= self.ctx.tensor
        length = -(-longest // multiple) * multiple
        tokens = torch.full((len(rows), length), self.tok.eod, dtype=torch.long)
        labels = torch.full_like(tokens, self.tok.eod)
        mask = torch.zeros_like(tokens, dtype=torch.float)
        for i, (row, target) in enumerate(zip(rows, targets)):
            tokens[i, :len(row)] = torch.tensor(row)
            labels[i, :len(target)] = torch.tensor(target)
            mask[i, :len(row)] = 1.0
        if self.before is not None:
            self.before()
        self.model.eval()
        batch = {"tokens": tokens, "labels": labels, "loss_mask": mask}
        shape = (length, len(rows), self.hidden_size)
        reports = run_schedule(self.model, [batch], self.ctx, shape,
                               make_score_step(self.ctx, self.vocab_size), forward_only=True,
                               gemm=self.gemm)
        if self.ctx.last_stage:
            logprob = reports[0]["logprob"].float()
            argmax = reports[0]["argmax"].long()
        else:
            logprob = torch.empty(tokens.shape, device=self.ctx.device)
            argmax = torch.empty(tokens.shape, dtype=torch.long, device=self.ctx.device)
        if self.ctx.pipeline > 1:
            src = ps.get_pipeline_model_parallel_last_rank()
            group = ps.get_pipeline_model_parallel_group()
            dist.broadcast(logprob, src=src, group=group)
            dist.broadcast(argmax, src=src, group=group)
        return logprob.cpu(), argmax.cpu()

    def loglikelihood(self, requests, disable_tqdm: bool = True):
        """lm-eval's tokenizing of (context, continuation) pairs, then the scores below;
        without its progress bar (the run's log gets one line per evaluation)."""
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """((context, continuation), context ids, continuation ids) -> (sum of the
        continuation's log-probabilities, whether greedy decoding gives the continuation)."""

        def window(req):
            _, context, continuation = req
            whole = (context + continuation)[-(self.max_length + 1):]
            return whole[:-1], whole[1:], len(continuation)

        collator = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        results = []
        for chunk in collator.get_batched(n=self.batch_size):
            rows, targets, conts = zip(*(window(r) for r in chunk))
            logprob, argmax = self._forward(list(rows), list(targets))
            for i, (row, target, n) in enumerate(zip(rows, targets, conts)):
                span = slice(len(row) - n, len(row))
                answer = (float(logprob[i, span].sum()),
                          bool((argmax[i, span] == torch.tensor(target[span])).all()))
                results.append(answer)
                if chunk[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", chunk[i][0], answer)
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood, in disjoint windows of max_length tokens, the first
        conditioned on the prefix token (lm-eval's rolling windows, as HFLM)."""
        windows, owner = [], []
        for index, req in enumerate(requests):
            (text,) = req.args
            for w in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(((None, None), list(w[0]), list(w[1])))
                owner.append(index)
        scores = self._loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for index, (logprob, _greedy) in zip(owner, scores):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context until one of its `until` strings, the
        end-of-document token or `max_gen_toks` tokens (no KV cache: each new token runs the
        whole sequence, fine for the short answers of the tasks this is for)."""
        results = []
        eot = self.tok_decode([self.eot_token_id])
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs or {})
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise ValueError(f"generate_until: this model decodes greedily only, but the task "
                                 f"asks for sampling ({kwargs})")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            limit = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = (self.tok_encode(context) or [self.prefix_token_id])
            generated: list[int] = []
            text = ""
            for _ in range(limit):
                row = (ids + generated)[-self.max_length:]
                _, argmax = self._forward([row], [row[1:] + [self.tok.eod]])
                token = int(argmax[0, len(row) - 1])
                if token == self.eot_token_id:
                    break
                generated.append(token)
                text = self.tok_decode(generated)
                if any(stop in text for stop in until + [eot]):
                    break
            for stop in until + [eot]:
                text = text.split(stop)[0] if stop else text
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            results.append(text)
        return results
