"""ProjectLM (training/lm_eval_model.py): lm-eval's requests answered by the project's model.

The check here: the log-likelihood of a continuation equals the sum of the model's own token
log-probabilities over the tokenizer's vocabulary, computed from a plain forward of the model (no
lm-eval, no schedule), and a request scores the same alone or padded into a batch with longer
ones; under emulated NVFP4 the scores are those of a direct forward of the same padded batch.
The comparison with lm-eval's own HFLM on the HF export is tests/system/test_eval_independent.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from model.build import build_model  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from nvfp4_recipe.policy import PrecisionConfig  # noqa: E402
from training.lm_eval_model import ProjectLM  # noqa: E402


# 16 Mamba heads: in_proj's width (2 x 256 + 2 x state + heads) a multiple of NVFP4's 16-blocks.
CFG = ModelConfig(pattern="M*-", hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_query_groups=2, kv_channels=16, mamba_num_heads=16, mamba_head_dim=16,
                  max_sequence_length=256)
# Every layer's linears in NVFP4 (the demo depth's BF16 first/last layers would leave none here).
NVFP4 = PrecisionConfig(format="nvfp4", bf16_first_layers=0, bf16_last_layers=0)


def project_lm(model, tok, ctx) -> ProjectLM:
    return ProjectLM(model, tok, ctx, hidden_size=64, max_length=256, batch_size=3,
                     max_gen_toks=4)


@pytest.fixture(scope="module")
def lm(parallel_context, tiny_tokenizer):
    from data.tokenizer import load_tokenizer_spec

    torch.manual_seed(0)
    tok = load_tokenizer_spec(tiny_tokenizer)
    built = build_model(CFG, PrecisionConfig(), vocab_size=tok.tokenizer.get_vocab_size())
    return project_lm(built.module, tok, parallel_context)


@pytest.fixture(scope="module")
def nvfp4_lm(lm):
    """The same weights as `lm`'s, every linear's forward in emulated NVFP4."""
    built = build_model(CFG, NVFP4, vocab_size=VOCAB)
    built.module.load_state_dict(lm.model.state_dict())
    return project_lm(built.module, lm.tok, lm.ctx)


VOCAB = 300  # the tiny tokenizer's; the model's output layer is padded to 384 rows


def direct_logprob(lm: ProjectLM, context: str, continuation: str) -> float:
    """Sum over the continuation of log p(token | prefix), from one plain forward, normalized
    over the tokenizer's vocabulary (the padding rows are no token: the HF export drops them)."""
    ctx_ids, cont_ids = lm.tok_encode(context), lm.tok_encode(continuation)
    ids = torch.tensor([ctx_ids + cont_ids])
    lm.model.eval()
    with torch.no_grad(), lm.ctx.hardware.gemm_compute().context():
        logits = lm.model(ids[:, :-1], None, None).float()
    assert logits.shape[-1] == 384  # so the test below can tell padded from unpadded
    logp = torch.log_softmax(logits[..., :VOCAB], -1)[0]
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
    logp = torch.log_softmax(logits[..., :VOCAB], -1)[0]
    expected = sum(float(logp[p, ids[p + 1]]) for p in range(len(ids) - 1))
    assert total == pytest.approx(expected, abs=1e-4)


PAIRS = [("alpha beta", " gamma delta"), ("kappa", " lambda mu eta"),
         ("alpha beta gamma delta epsilon zeta eta theta iota", " kappa")]


def direct_batch_logprobs(lm: ProjectLM, pairs) -> list[float]:
    """Each continuation's log-likelihood from one plain forward of all pairs as one batch,
    right-padded with the end-of-document token to a multiple of 64 positions. NVFP4 scales each
    activation tensor by its amax over the whole batch, so a row's scores depend on its batch:
    the reference is the batch ProjectLM forwards, not each row alone."""
    rows = [lm.tok_encode(c) + lm.tok_encode(x) for c, x in pairs]
    length = -(-max(len(r) - 1 for r in rows) // 64) * 64
    inputs = torch.full((len(rows), length), lm.tok.eod)  # a row's last token is no input
    for i, row in enumerate(rows):
        inputs[i, :len(row) - 1] = torch.tensor(row[:-1])
    lm.model.eval()
    with torch.no_grad(), lm.ctx.hardware.gemm_compute().context():
        logits = lm.model(inputs, None, None).float()
    logp = torch.log_softmax(logits[..., :VOCAB], -1)
    out = []
    for i, ((context, _), row) in enumerate(zip(pairs, rows)):
        start = len(lm.tok_encode(context)) - 1
        out.append(sum(float(logp[i, p, row[p + 1]]) for p in range(start, len(row) - 1)))
    return out


def test_nvfp4_scores_are_a_direct_forward_of_the_batch_and_not_bf16s(lm, nvfp4_lm):
    from nvfp4_recipe.megatron.parallel_linear import _PrecisionLinearMixin

    quantized = [m for m in nvfp4_lm.model.modules()
                 if isinstance(m, _PrecisionLinearMixin) and m.gemm_config is not None]
    assert len(quantized) >= 4  # in_proj, out_proj, qkv, proj, fc1, fc2: NVFP4 GEMMs
    nvfp4 = [ll for ll, _ in nvfp4_lm.loglikelihood(requests("loglikelihood", PAIRS))]
    bf16 = [ll for ll, _ in lm.loglikelihood(requests("loglikelihood", PAIRS))]
    # Same operands, same kernels, same summation: only the order of the final sums differs.
    assert nvfp4 == pytest.approx(direct_batch_logprobs(nvfp4_lm, PAIRS), abs=1e-4)
    # The NVFP4 forward is not the BF16 one on the same weights, and not far from it: 4-bit
    # operands with FP8 block scales move these ~-6-nats-per-token scores by hundredths of a
    # nat (measured 0.027-0.049 per request, 0.007-0.024 per token, at this seed; bounded at
    # 0.1 per token, 4x the largest).
    tokens = [len(lm.tok_encode(x)) for _, x in PAIRS]
    diffs = [abs(a - b) for a, b in zip(nvfp4, bf16)]
    assert max(diffs) > 1e-3, diffs
    assert all(d < 0.1 * n for d, n in zip(diffs, tokens)), (diffs, tokens)


def test_nvfp4_through_lm_eval_gives_finite_scores_quietly(nvfp4_lm, capfd):
    import math

    from training.downstream import evaluate, flat_metrics, prepare_tasks

    tasks = ["demo_arith_choice"]
    capfd.readouterr()
    results = evaluate(nvfp4_lm, tasks, prepare_tasks(tasks), limit=4, log_samples=True)
    # No progress bars or lm-eval hints: the run's log gets one line per evaluation.
    printed = "".join(capfd.readouterr())
    assert "it/s" not in printed and "--metadata" not in printed, printed
    metrics = flat_metrics(results)
    assert 0.0 <= metrics["eval/demo_arith_choice/acc"] <= 1.0
    samples = results["samples"]["demo_arith_choice"]
    assert len(samples) == 4
    scores = [ll for sample in samples for (ll, _greedy) in sample["filtered_resps"]]
    assert len(scores) == 16 and all(math.isfinite(s) and s < 0 for s in scores)
