"""The chunked FP32 LM head (tmax.train.head): the same log-probs, entropies and gradients
as the plain full-logits path, no [T, V] tensor kept for the backward, and activation
checkpointing that changes nothing but memory."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from tmax.rl import entropy_from_logits
from tmax.train.config import AlgoSection, OptimSection
from tmax.train.head import chunked_token_logprobs, install_scoring_head, score_tokens
from tmax.train.trainer import Sample, Trainer, logits_of, logprobs_of_logits, pad_batch

H = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
W = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [-1.0, 0.0]])
TARGETS = torch.tensor([0, 3, 1])


def test_a_hand_computed_case():
    # logits rows: [1, 0, 0, -1], [0, 1, 0, 0], [1, 1, 0, -1]; temperature 2 halves them
    rows = [[1, 0, 0, -1], [0, 1, 0, 0], [1, 1, 0, -1]]
    for temperature in (1.0, 2.0):
        logp, entropy = chunked_token_logprobs(H, W, None, TARGETS, temperature=temperature,
                                               chunk=2)
        for i, (row, t) in enumerate(zip(rows, TARGETS.tolist())):
            z = [v / temperature for v in row]
            lse = math.log(sum(math.exp(v) for v in z))
            assert logp[i].item() == pytest.approx(z[t] - lse, abs=1e-6)
            p = [math.exp(v - lse) for v in z]
            assert entropy[i].item() == pytest.approx(-sum(q * math.log(q) for q in p),
                                                      abs=1e-6)
    # d logp_0 / d h_0 = W[t] - sum_v p_v W[v]  (temperature 1)
    h = H.clone().requires_grad_(True)
    logp, _ = chunked_token_logprobs(h, W, None, TARGETS, chunk=2)
    logp[0].backward()
    p = torch.softmax(torch.tensor([1.0, 0.0, 0.0, -1.0]), 0)
    expected = W[0] - (p[:, None] * W).sum(0)
    assert torch.allclose(h.grad[0], expected, atol=1e-6)
    assert torch.count_nonzero(h.grad[1:]) == 0


@pytest.mark.parametrize("chunk", [1, 2, 7, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_log_probs_and_gradients_equal_the_unchunked_path(chunk, with_bias):
    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(11, 8, generator=g, dtype=torch.float64)
    bias = torch.randn(11, generator=g, dtype=torch.float64) if with_bias else None
    targets = torch.randint(0, 11, (2, 5), generator=g)
    upstream = torch.randn(2, 5, generator=g, dtype=torch.float64)
    temperature = 0.7

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight)]
        b = bias.clone().requires_grad_(True) if bias is not None else None
        logp, entropy = fn(*leaves, b)
        (logp * upstream).sum().backward()
        return logp.detach(), entropy.detach(), [x.grad for x in leaves] + \
            ([b.grad] if b is not None else [])

    def plain(h, w, b):
        z = F.linear(h, w, b) / temperature                                 # [2,5,V]
        return (z.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1),
                entropy_from_logits(z))

    def chunked(h, w, b):
        return chunked_token_logprobs(h, w, b, targets, temperature=temperature,
                                      chunk=chunk, fp32=False)

    ref, got = grads(plain), grads(chunked)
    assert torch.allclose(got[0], ref[0], atol=1e-12)
    assert torch.allclose(got[1].float(), ref[1], atol=1e-6)  # entropy_from_logits: float32
    for a, b in zip(got[2], ref[2], strict=True):
        assert a.dtype == b.dtype
        assert torch.allclose(a, b, atol=1e-12), (a - b).abs().max()


def tiny_llama(vocab: int = 97, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True))


def samples(vocab: int = 97) -> list[Sample]:
    rng = random.Random(3)
    out = []
    for n in (9, 14, 5):
        mask = [0] * 3 + [1] * (n - 3)
        out.append(Sample([rng.randrange(vocab) for _ in range(n)],
                          [-rng.random() * 2 * m for m in mask], mask,
                          rng.choice([-0.5, 0.5])))
    return out


def trainer(model, **kw) -> Trainer:
    return Trainer(model, algo=AlgoSection(), optim=OptimSection(lr=1e-2, micro_batch_size=2),
                   total_steps=5, temperature=0.8, fp32_head=True, pad_id=0, max_len=64, **kw)


def reference_gradients(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The plain path: full [B, T, V] float32 logits, log_softmax, the same loss."""
    from tmax.train.trainer import policy_loss, response_tokens

    batch = pad_batch(samples(), 0)
    model.zero_grad()
    logits = logits_of(model, batch["input_ids"], batch["attention_mask"], fp32_head=True)
    logp, entropy = logprobs_of_logits(logits, batch["input_ids"], temperature=0.8)
    loss, _, _ = policy_loss(logp, entropy, batch, algo=AlgoSection(),
                             n_tokens=float(response_tokens(samples())))
    loss.backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_trainer_step_has_the_unchunked_gradients(checkpointing):
    ref_logp, ref_grads = reference_gradients(tiny_llama())
    t = trainer(tiny_llama(), head_chunk=4, activation_checkpointing=checkpointing)
    t.forward_backward(samples())
    grads = t.full_gradients()
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-6), \
            f"{name}: max |diff| {(g - ref_grads[name]).abs().max():.3g}"
    batch = pad_batch(samples(), 0)
    with torch.no_grad():
        logp, _ = score_tokens(t.model, batch["input_ids"], batch["attention_mask"],
                               temperature=0.8)
    assert torch.allclose(logp, ref_logp, atol=1e-6)


def test_the_backward_keeps_no_full_vocabulary_tensor():
    vocab, n = 4099, 64
    model = tiny_llama(vocab)
    install_scoring_head(model, chunk=4)
    ids = torch.randint(0, vocab, (1, n))
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _logp, _ = score_tokens(model, ids, torch.ones_like(ids), temperature=1.0)
    # the largest thing it may keep is the head's weight itself [V, 16]
    big = [x for x in saved if x > 16 * vocab]
    assert big == [], f"saved for backward: {big} elements (vocab {vocab})"
    # the plain path keeps [T, V] logits: the check above would catch it
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs_of_logits(logits_of(model, ids, torch.ones_like(ids), fp32_head=True),
                           ids, temperature=1.0)
    assert max(saved) >= (n - 1) * vocab


def test_outside_scoring_the_head_gives_float32_logits():
    model = tiny_llama().to(torch.bfloat16)
    install_scoring_head(model, fp32=True)
    ids = torch.tensor([[1, 2, 3]])
    out = model(input_ids=ids).logits
    assert out.dtype == torch.float32 and out.shape == (1, 3, 97)
    logp, _entropy = score_tokens(model, ids, torch.ones_like(ids), temperature=1.0)
    assert logp.dtype == torch.float32 and logp.shape == (1, 2)
    assert torch.allclose(logp, out[:, :-1].log_softmax(-1).gather(
        -1, ids[:, 1:, None]).squeeze(-1), atol=1e-5)


def test_a_copy_of_the_model_and_another_thread_get_logits_of_their_own():
    import copy
    import threading

    from tmax.train.head import scoring

    model = tiny_llama()
    install_scoring_head(model)
    twin = copy.deepcopy(model)  # the in-process engine's copy of a one-process run
    with torch.no_grad():
        twin.get_output_embeddings().weight.mul_(2)
    ids = torch.tensor([[1, 2, 3]])
    seen = {}
    with scoring(model, ids[:, 1:], 1.0):
        seen["scoring"] = model(input_ids=ids).logits.shape
        seen["twin"] = twin(input_ids=ids).logits
        thread = threading.Thread(target=lambda: seen.update(other=model(input_ids=ids).logits))
        thread.start()
        thread.join()
    assert seen["scoring"] == (1, 2, 2)
    assert seen["other"].shape == seen["twin"].shape == (1, 3, 97)
    hidden = twin.get_decoder()(input_ids=ids).last_hidden_state
    expected = hidden @ twin.get_output_embeddings().weight.T  # the twin's own (doubled) head
    assert torch.allclose(seen["twin"], expected, atol=1e-5)
