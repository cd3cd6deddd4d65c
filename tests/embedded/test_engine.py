"""The embedded server's engine in process, on the tiny model: KV-cache surgery, scheduling, stops, pause, reload."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from asyncgrpo_cli.embedded.engine import GenerationEngine
from asyncgrpo_cli.embedded.kvcache import BatchKV, PrefixCache, RowKV, prefill, prefill_inputs
from asyncgrpo_cli.embedded.model import load_model, load_weights_dir
from asyncgrpo_cli.embedded.requests import GenerationRequest
from asyncgrpo_cli.embedded.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Reference forwards on one thread (see the conftest fixture)."""


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def _engine(model, **kw) -> GenerationEngine:
    kw.setdefault("eos_token_ids", [])
    kw.setdefault("max_model_len", 256)
    return GenerationEngine(model, **kw)


def _run_until_done(engine: GenerationEngine, handles, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if all(h.done for h in handles):
            return
        engine.step()
    raise AssertionError("requests did not finish")


def _prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


def test_prefill_mask_lets_padding_attend_only_to_itself():
    ids, mask, pos = prefill_inputs([[5, 6, 7], [8]])
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]
    row = mask[1, 0]
    assert row[0].tolist() == [True, False, False]  # padding query: itself only
    assert row[2].tolist() == [False, False, True]  # real token: never the padding


@torch.inference_mode()
def test_rebuild_and_decode_match_a_full_forward(model):
    """Rows join, get reordered and leave between decode steps; every logit matches an unbatched forward."""
    prompts = _prompts(5, 12, 3, 9)
    rows, _ = prefill(model, prompts[:2])
    kv = BatchKV()
    kv.rebuild([], rows)
    seqs = [list(p) for p in prompts[:2]]
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        if step == 2:  # two rows join, and the running rows swap places
            new_rows, _ = prefill(model, prompts[2:])
            kv.rebuild([1, 0], new_rows)
            seqs = [seqs[1], seqs[0]] + [list(p) for p in prompts[2:]]
        if step == 4:  # one row leaves
            kv.rebuild([0, 2, 3], [])
            seqs = [seqs[0], seqs[2], seqs[3]]
        tokens = torch.randint(0, 1000, (kv.batch_size,), generator=g)
        mask, positions = kv.decode_inputs()
        out = model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=positions,
            cache=kv.cache,
            use_cache=True,
        )
        kv.advance()
        assert kv.width == max(kv.lengths)  # no column holds only padding
        for i, s in enumerate(seqs):
            s.append(int(tokens[i]))
            ref = model(input_ids=torch.tensor([s])).logits[0, -1]
            torch.testing.assert_close(out.logits[i, -1], ref, atol=1e-4, rtol=0)
            kv_row = kv.row(i)
            assert kv_row.length == len(s)


def test_slab_layer_grows_past_its_headroom(model):
    with torch.inference_mode():
        rows, _ = prefill(model, _prompts(4))
        kv = BatchKV()
        kv.rebuild([], rows)
        capacity = kv.cache.layers[0]._kbuf.shape[2]
        for _ in range(capacity - kv.width + 3):
            mask, positions = kv.decode_inputs()
            model(
                input_ids=torch.tensor([[7]]),
                attention_mask=mask,
                position_ids=positions,
                cache=kv.cache,
                use_cache=True,
            )
            kv.advance()
        assert kv.cache.layers[0]._kbuf.shape[2] > capacity
        assert kv.cache.layers[0].keys.shape[2] == kv.width


def test_prefix_cache_is_an_lru():
    cache = PrefixCache(2)
    row = RowKV([(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))])
    for p in [(1,), (2,), (3,)]:
        cache.put(p, row, torch.zeros(3))
    assert (1,) not in cache and (2,) in cache and (3,) in cache
    cache.get((2,))
    cache.put((4,), row, torch.zeros(3))
    assert (3,) not in cache and (2,) in cache
    cache.clear()
    assert len(cache) == 0


def test_a_group_prefills_its_prompt_once_and_matches_a_single_request(model):
    prompt = _prompts(20)[0]
    engine = _engine(model)
    group = [engine.submit(GenerationRequest(prompt, 8, GREEDY)) for _ in range(4)]
    n_req = engine.submit(GenerationRequest(prompt, 8, SamplingParams(temperature=1.0), n=3, seed=11))
    _run_until_done(engine, group + [n_req])
    assert engine.stats().prefill_tokens_total == len(prompt)
    outs = [h.completions[0].token_ids for h in group]
    assert all(o == outs[0] for o in outs)
    assert len({tuple(c.token_ids) for c in n_req.completions}) == 3  # seeds seed+0, seed+1, seed+2
    later = engine.submit(GenerationRequest(prompt, 8, GREEDY))
    _run_until_done(engine, [later])
    assert engine.stats().prefix_cache_hits_total >= 1
    assert engine.stats().prefill_tokens_total == len(prompt)
    assert later.completions[0].token_ids == outs[0]


def test_stop_tokens_eos_and_ignore_eos(model):
    prompt = _prompts(6)[0]
    probe = _engine(model)
    h = probe.submit(GenerationRequest(prompt, 1, GREEDY))
    _run_until_done(probe, [h])
    first = h.completions[0].token_ids[0]

    engine = _engine(model, eos_token_ids=[first])
    eos = engine.submit(GenerationRequest(prompt, 5, GREEDY))
    stop = engine.submit(GenerationRequest(prompt, 5, GREEDY, stop_token_ids=(first,), ignore_eos=True))
    ignored = engine.submit(GenerationRequest(prompt, 5, GREEDY, ignore_eos=True))
    _run_until_done(engine, [eos, stop, ignored])
    c = eos.completions[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([first], "stop", None)
    c = stop.completions[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([first], "stop", first)
    c = ignored.completions[0]
    assert (len(c.token_ids), c.finish_reason) == (5, "length")
    stats = engine.stats()
    assert stats.request_success_total == {"stop": 2, "length": 1, "abort": 0}
    assert stats.running == 0 and stats.kv_usage == 0.0


def test_admission_respects_max_num_seqs_and_kv_tokens(model):
    engine = _engine(model, max_model_len=100, kv_cache_tokens=150, max_num_seqs=3)
    handles = [engine.submit(GenerationRequest(p, 50, GREEDY)) for p in _prompts(10, 10, 10, 10)]
    engine.step()
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (2, 2)  # 60 tokens reserved each: a third does not fit in 150
    assert stats.kv_usage == pytest.approx(120 / 150)
    _run_until_done(engine, handles)
    assert engine.stats().preemptions_total == 0


def test_pause_wait_drains_in_flight_and_holds_new_requests(model):
    engine = _engine(model).start()
    try:
        first = engine.submit(GenerationRequest(_prompts(8)[0], 60, GREEDY))
        engine.pause("wait")
        assert first.done and first.completions[0].finish_reason == "length"
        held = engine.submit(GenerationRequest(_prompts(8)[0], 4, GREEDY))
        assert not held.wait(0.5)
        assert engine.stats().waiting == 1
        engine.resume()
        assert held.wait(30)
    finally:
        engine.shutdown()


def test_pause_abort_returns_partial_output(model):
    engine = _engine(model)
    h = engine.submit(GenerationRequest(_prompts(8)[0], 50, GREEDY))
    for _ in range(3):
        engine.step()
    engine.pause("abort")
    c = h.completions[0]
    assert h.done and c.finish_reason == "abort" and len(c.token_ids) == 3
    assert engine.is_paused and engine.stats().running == 0


def test_reload_rejects_a_bad_checkpoint_and_leaves_the_model_untouched(model, tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state["model.norm.weight"] = state["model.norm.weight"] + 1.0
    save_file({**state, "model.bogus.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unknown tensors.*model.bogus.weight"):
        load_weights_dir(model, tmp_path)
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors.*model\.layers\.0\.mlp\.up_proj\.weight"):
        load_weights_dir(model, tmp_path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    good = tmp_path / "good"
    good.mkdir()
    shutil.copy(tiny_model_dir / "model.safetensors", good / "model.safetensors")
    assert load_weights_dir(model, good) == len(state) + 1  # every tensor but the tied lm_head alias


def test_engine_thread_serves_concurrent_submitters(model):
    engine = _engine(model, max_num_seqs=4).start()
    results: list = []
    try:

        def worker(i: int) -> None:
            h = engine.submit(
                GenerationRequest(_prompts(5 + i)[0], 6, SamplingParams(temperature=1.0), seed=i)
            )
            assert h.wait(60)
            results.append(h.completions[0])

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        engine.shutdown()
    assert len(results) == 8 and all(len(c.token_ids) == 6 for c in results)
