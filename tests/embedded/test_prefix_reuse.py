"""Prefix reuse in the embedded engine, on the tiny model: ``prefill_tails`` equals a full prefill,
``PrefixCache.longest_prefix`` finds the longest cached start, and a conversation's turn 2 (turn 1 + reply + tool
tokens) continued from the cached reply samples what an engine without a prefix cache samples; weight updates and
LoRA adapters keep stale or foreign entries out."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo_cli.embedded.engine import GenerationEngine
from asyncgrpo_cli.embedded.kvcache import PrefixCache, RowKV, prefill, prefill_tails
from asyncgrpo_cli.embedded.model import load_model
from asyncgrpo_cli.embedded.requests import Completion, GenerationRequest
from asyncgrpo_cli.embedded.sampling import SamplingParams

SAMPLED = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Forwards on one thread (see the conftest fixture)."""


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def _tokens(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


def _engine(model, **kw) -> GenerationEngine:
    return GenerationEngine(model, eos_token_ids=[], max_model_len=512, **kw)


def _generate(engine, prompts, seeds, *, stops=None, max_tokens=12, adapter=None) -> list[Completion]:
    handles = [
        engine.submit(
            GenerationRequest(p, max_tokens, SAMPLED, seed=s, stop_token_ids=tuple(st or ()), adapter=adapter)
        )
        for p, s, st in zip(prompts, seeds, stops or [None] * len(prompts))
    ]
    for _ in range(200):
        if all(h.done for h in handles):
            return [h.completions[0] for h in handles]
        engine.step()
    raise AssertionError("requests did not finish")


def _stop_token(tokens: list[int], start: int = 4) -> int:
    """A token sampled at ``start`` or later and not before: stopping on it ends the reply there."""
    for k in range(start, len(tokens)):
        if tokens[k] not in tokens[:k]:
            return tokens[k]
    raise AssertionError(f"no fresh token after position {start} in {tokens}")


def _turn_one(model, prompts, seeds, adapter=None) -> list[list[int]]:
    """Stop tokens that end each prompt's seeded reply after a few tokens with finish reason ``stop``."""
    probe = _generate(_engine(model, prefix_cache_size=0), prompts, seeds, max_tokens=16, adapter=adapter)
    return [[_stop_token(c.token_ids)] for c in probe]


def _assert_same(a: list[Completion], b: list[Completion]) -> None:
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


def _assert_rows_close(a: RowKV, b: RowKV) -> None:
    assert a.length == b.length
    for (ka, va), (kb, vb) in zip(a.layers, b.layers):
        torch.testing.assert_close(ka, kb, atol=1e-5, rtol=0)
        torch.testing.assert_close(va, vb, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_prefill_tails_equal_a_full_prefill(model):
    """One batch of tails of different lengths after pasts of different lengths (one crossing 200 tokens), and
    a single tail, against each prompt prefilled whole on its own."""
    prompts = _tokens(40, 320, 17, 9)
    cuts = [10, 120, 16, 1]
    pasts, _ = prefill(model, [p[:c] for p, c in zip(prompts, cuts)])
    rows, logits = prefill_tails(model, pasts, [p[c:] for p, c in zip(prompts, cuts)])
    for i, p in enumerate(prompts):
        (ref,), ref_logits = prefill(model, [p])
        _assert_rows_close(rows[i], ref)
        torch.testing.assert_close(logits[i], ref_logits[0], atol=1e-5, rtol=0)
    (one,), one_logits = prefill_tails(model, [pasts[1]], [prompts[1][cuts[1] :]])
    _assert_rows_close(one, rows[1])
    torch.testing.assert_close(one_logits[0], logits[1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="non-empty tails"):
        prefill_tails(model, pasts[:1], [[]])


def test_longest_prefix_finds_the_longest_cached_start_of_the_same_adapter():
    cache, adapter = PrefixCache(7), object()

    def entry(n: int) -> tuple[RowKV, torch.Tensor]:
        return RowKV([(torch.zeros(1, n, 2), torch.zeros(1, n, 2))]), torch.full((3,), float(n))

    for tokens in [(1, 2, 3), (1, 2, 3, 4, 5), (1, 2, 9), (7,), (1, 2, 3, 4, 5, 6, 7, 8)]:
        cache.put(tokens, *entry(len(tokens)))
    cache.put((1, 2, 3, 4, 5, 6), *entry(6), adapter=adapter)
    hit = cache.longest_prefix((1, 2, 3, 4, 5, 6, 7))
    assert hit is not None and hit.length == 5 and hit.row.length == 5 and hit.logits[0] == 5.0
    assert cache.longest_prefix((1, 2, 3, 4, 5, 6, 7), adapter).length == 6
    assert cache.longest_prefix((1, 2, 3)).length == 3  # exact
    assert cache.longest_prefix((1, 2)) is None and cache.longest_prefix((2, 3, 4)) is None
    assert cache.longest_prefix((1, 2, 3), adapter) is None
    assert (cache.queries, cache.hits, cache.reused_tokens) == (6, 3, 14)
    assert cache.cached_length((1, 2, 9, 9)) == 3 and cache.cached_length((5,)) == 0
    assert cache.queries == 6  # cached_length does not count
    cache.put((8,), *entry(1))
    cache.put((9,), *entry(1))  # evicts the least recently used: (1, 2, 9), not the hits
    assert cache.cached_length((1, 2, 9, 9)) == 0 and cache.cached_length((1, 2, 3, 4, 5, 0)) == 5
    epoch = cache.epoch
    cache.clear()
    assert len(cache) == 0 and cache.epoch == epoch + 1


def test_turn_two_from_the_cached_reply_samples_as_without_a_prefix_cache(model):
    """Three conversations: turn 1 stops after a few tokens, turn 2 (turn 1 + reply + tool tokens) reuses the
    cached reply (prompt + reply but its last token) and prefills only the rest, in one batch of tails."""
    firsts, seeds = _tokens(30, 24, 36), [0, 1, 2]
    stops = _turn_one(model, firsts, seeds)
    plain, cached = _engine(model, prefix_cache_size=0), _engine(model)
    one = [_generate(e, firsts, seeds, stops=stops) for e in (plain, cached)]
    _assert_same(*one)
    assert all(c.finish_reason == "stop" and len(c.token_ids) >= 5 for c in one[0])
    tools = _tokens(20, 9, 41, seed=1)
    seconds = [p + c.token_ids + t for p, c, t in zip(firsts, one[1], tools)]
    reused = [len(p) + len(c.token_ids) - 1 for p, c in zip(firsts, one[1])]
    assert [cached.prefix_cache.cached_length(tuple(s)) for s in seconds] == reused
    before = cached.stats()
    two = [_generate(e, seconds, [10, 11, 12]) for e in (plain, cached)]
    _assert_same(*two)
    after = cached.stats()
    assert after.prefix_cache_hits_total - before.prefix_cache_hits_total == 3
    assert after.prefix_cache_reused_tokens_total - before.prefix_cache_reused_tokens_total == sum(reused)
    assert after.prefill_tokens_total - before.prefill_tokens_total == sum(len(t) + 1 for t in tools)
    assert plain.stats().prefill_tokens_total == sum(map(len, firsts)) + sum(map(len, seconds))
    for s, c in zip(seconds, two[1]):  # a reply cut at max_tokens is not cached: only its prompt is
        assert c.finish_reason == "length" and cached.prefix_cache.cached_length(
            tuple(s + c.token_ids)
        ) == len(s)


def test_a_weight_update_drops_cached_kv_and_kv_in_flight(tiny_model_dir):
    model = load_model(tiny_model_dir)  # its weights change here
    firsts, seeds = _tokens(30, 26, seed=2), [3, 4]
    stops = _turn_one(model, firsts, seeds)
    engine = _engine(model)
    (done,) = _generate(engine, firsts[:1], seeds[:1], stops=stops[:1])
    second = tuple(firsts[0] + done.token_ids + [5, 6, 7])
    assert engine.prefix_cache.cached_length(second) == len(second) - 4
    engine.apply_weights(lambda m: m.model.norm.weight.mul_(1.5))
    assert len(engine.prefix_cache) == 0

    flight = engine.submit(
        GenerationRequest(firsts[1], 12, SAMPLED, seed=seeds[1], stop_token_ids=tuple(stops[1]))
    )
    engine.step()
    engine.step()
    engine.reload_weights(tiny_model_dir)  # the original weights again, mid-reply
    while not flight.done:
        engine.step()
    assert flight.completions[0].finish_reason == "stop"
    assert len(engine.prefix_cache) == 0  # neither its prompt (cleared) nor its reply (KV of two weight sets)

    (again,) = _generate(engine, firsts[1:], seeds[1:], stops=stops[1:])
    assert (
        engine.prefix_cache.cached_length(tuple(firsts[1] + again.token_ids + [5]))
        == len(firsts[1]) + len(again.token_ids) - 1
    )  # the same epoch from admission to finish: cached


def test_lora_adapters_keep_their_entries_apart(tiny_model_dir, tmp_path):
    from asyncgrpo_cli.embedded.lora import AdapterSet
    from tests.test_lora import lora_model, write_version

    base = load_model(tiny_model_dir)
    adapters = AdapterSet(base, "tiny")
    adapters.load(
        {"lora_name": "a", "lora_path": write_version(lora_model(tiny_model_dir, seed=3), tmp_path)}
    )
    lora = adapters.get("a")
    firsts, seeds = _tokens(28, seed=3), [5]
    stops = _turn_one(base, firsts, seeds, adapter=lora)
    plain, cached = _engine(base, prefix_cache_size=0), _engine(base)
    (reply,) = _generate(cached, firsts, seeds, stops=stops, adapter=lora)
    second = firsts[0] + reply.token_ids + _tokens(12, seed=4)[0]
    assert cached.prefix_cache.cached_length(tuple(second)) == 0  # the base model has no entry
    assert cached.prefix_cache.cached_length(tuple(second), lora) == len(firsts[0]) + len(reply.token_ids) - 1
    for adapter in (None, lora):
        hits = cached.stats().prefix_cache_hits_total
        _assert_same(
            _generate(plain, [second], [6], adapter=adapter),
            _generate(cached, [second], [6], adapter=adapter),
        )
        assert cached.stats().prefix_cache_hits_total - hits == (adapter is lora)
