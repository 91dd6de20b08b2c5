"""ProjectLM (training/lm_eval_model.py): lm-eval's requests answered by the project's model.

The independent check: the log-likelihood of a continuation equals the sum of the model's own
token log-probabilities, computed here from a plain forward of the model (no lm-eval, no
schedule), and a request scores the same alone or padded into a batch with longer ones."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from model.build import build_model  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from nvfp4_recipe.policy import PrecisionConfig  # noqa: E402
from training.lm_eval_model import ProjectLM  # noqa: E402


@pytest.fixture(scope="module")
def lm(parallel_context, tiny_tokenizer):
    from data.tokenizer import load_tokenizer_spec

    torch.manual_seed(0)
    tok = load_tokenizer_spec(tiny_tokenizer)
    cfg = ModelConfig(pattern="M*-", hidden_size=64, ffn_hidden_size=128,
                      num_attention_heads=4, num_query_groups=2, kv_channels=16, mamba_num_heads=4,
                      mamba_head_dim=16, max_sequence_length=256)
    built = build_model(cfg, PrecisionConfig(), vocab_size=tok.tokenizer.get_vocab_size())
    return ProjectLM(built.module, tok, parallel_context, hidden_size=64, max_length=256,
                     batch_size=3, max_gen_toks=4)


def direct_logprob(lm: ProjectLM, context: str, continuation: str) -> float:
    """Sum over the continuation of log p(token | prefix), from one plain forward."""
    ctx_ids, cont_ids = lm.tok_encode(context), lm.tok_encode(continuation)
    ids = torch.tensor([ctx_ids + cont_ids])
    lm.model.eval()
    with torch.no_grad(), lm.ctx.hardware.gemm_compute().context():
        logits = lm.model(ids[:, :-1], None, None).float()
    logp = torch.log_softmax(logits, -1)[0]
    positions = range(len(ctx_ids) - 1, ids.shape[1] - 1)
    return sum(float(logp[p, ids[0, p + 1]]) for p in positions)


def requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_loglikelihood_is_the_sum_of_the_models_token_logprobs(lm):
    pairs = [("alpha beta", " gamma delta"), ("kappa", " lambda mu eta"),
             ("alpha beta gamma delta epsilon zeta eta theta iota", " kappa")]
    batched = lm.loglikelihood(requests("loglikelihood", pairs))
    for (context, continuation), (logprob, greedy) in zip(pairs, batched):
        assert logprob == pytest.approx(direct_logprob(lm, context, continuation), abs=1e-4)
        assert isinstance(greedy, bool)
    # Alone (no padding) and in a batch padded to the longest: the same numbers.
    alone = [lm.loglikelihood(requests("loglikelihood", [p]))[0] for p in pairs]
    for a, b in zip(alone, batched):
        assert a[0] == pytest.approx(b[0], abs=1e-5) and a[1] == b[1]


def test_greedy_flag_matches_greedy_generation(lm):
    context = "alpha beta gamma"
    (text,) = lm.generate_until(requests("generate_until",
                                         [(context, {"until": ["\n"], "max_gen_toks": 2})]))
    ids = lm.tok_encode(text)
    assert 1 <= len(ids) <= 2
    # What greedy decoding produced is, by the loglikelihood request, the greedy continuation.
    (_, greedy), = lm.loglikelihood(requests("loglikelihood", [(context, text)]))
    assert greedy


def test_rolling_loglikelihood_sums_windows_from_the_prefix_token(lm):
    text = "alpha beta gamma delta epsilon"
    (total,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    ids = [lm.prefix_token_id] + lm.tok_encode(text)
    lm.model.eval()
    with torch.no_grad(), lm.ctx.hardware.gemm_compute().context():
        logits = lm.model(torch.tensor([ids[:-1]]), None, None).float()
    logp = torch.log_softmax(logits, -1)[0]
    expected = sum(float(logp[p, ids[p + 1]]) for p in range(len(ids) - 1))
    assert total == pytest.approx(expected, abs=1e-4)
