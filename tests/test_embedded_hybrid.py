"""The embedded server on a hybrid model (Qwen3.5: gated-DeltaNet linear-attention layers + attention layers) and
on a Qwen3-MoE, against transformers: greedy generation equals ``model.generate``, sampled and prompt log-probs
equal a full forward, a prompt that extends a cached one continues from the cached state, and the weight-sync
check passes after an update (and fails when one did not take).

The hybrid is ``builtin:tiny-qwen3.5`` with two traits of trained checkpoints that make state errors visible
(``long_memory_hybrid``): its random init forgets within a few tokens (decay rates ``A`` in [0.01, 16]) and
zeroes the embedding of the id the engine pads with, so a leaked or misplaced state would barely show. With slow
decays and a padding embedding like the others, a left-padded prefill batch (the dense path) is off by ~0.2 in the
logits of its shorter prompt, a padded tail after a cached state by ~0.3, and what the server does by ~3e-7.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from asyncgrpo_cli.config.schema import EmbeddedServerConfig, ServerConfig
from asyncgrpo_cli.embedded.engine import GenerationEngine
from asyncgrpo_cli.embedded.kvcache import BatchKV, linear_layers, prefill, prefill_tails
from asyncgrpo_cli.embedded.model import check_layer_types, load_model
from asyncgrpo_cli.embedded.prompt_logprobs import scored_prefill
from asyncgrpo_cli.embedded.requests import GenerationRequest
from asyncgrpo_cli.embedded.sampling import SamplingParams
from asyncgrpo_cli.model.resolve import resolve_model_path
from asyncgrpo_cli.server.control import ServerControl
from asyncgrpo_cli.server.launch import EmbeddedServerProcess
from asyncgrpo_cli.sync.disk import DiskWeightSync
from asyncgrpo_cli.sync.verify import WeightSyncMismatchError, verify_weight_sync

NAME = "tiny"
ATOL = 1e-4
"""Log-prob / logit tolerance (float32; the measured gaps are ~1e-6, the wrong designs' ~1)."""


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Reference forwards on one thread (see the conftest fixture)."""


def long_memory_hybrid(dest: Path) -> Path:
    """``tiny-qwen3.5`` with decay rates ``A`` in [0.005, 0.05] (the recurrent state carries tens of tokens) and a
    non-zero embedding for token 0 (the engine's padding id, whose row the init zeroes, as ``pad_token_id``), drawn
    as the other rows are."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model_path("builtin:tiny-qwen3.5")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            deltanet = getattr(layer, "linear_attn", None)
            if deltanet is not None:
                rates = torch.empty(deltanet.A_log.shape).uniform_(0.005, 0.05, generator=gen)
                deltanet.A_log.copy_(rates.log())
        model.model.embed_tokens.weight[0].normal_(0.0, model.config.initializer_range, generator=gen)
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(src).save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    return long_memory_hybrid(tmp_path_factory.mktemp("hybrid"))


def _reference(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def greedy_reference(model, prompt: list[int], new: int) -> list[int]:
    """transformers' own greedy decoding with its cache (stops at EOS, as the server does)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        max_new_tokens=new,
        use_cache=True,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def full_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward over ``tokens`` (no cache), float32 ``[len(tokens), V]``."""
    return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float().log_softmax(-1)


# -- the engine in process, on the hybrid ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    return load_model(hybrid_dir)


def test_the_hybrid_has_linear_layers_and_padded_batches_are_refused(hybrid):
    assert linear_layers(hybrid) == {0, 1, 2}
    a, b = _prompts(4, 7)
    with pytest.raises(ValueError, match="one length per batch"):
        prefill(hybrid, [a, b])
    rows, _ = prefill(hybrid, [a, b[:4]])
    with pytest.raises(ValueError, match="one length per batch"):
        prefill_tails(hybrid, rows, [[5], [6, 7]])


@pytest.mark.parametrize(
    "layer_types",
    [["sliding_attention", "full_attention"], ["linear_attention", "linear_attention"]],
)
def test_other_layer_types_are_refused_with_the_fix(layer_types):
    text = SimpleNamespace(layer_types=layer_types)
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda decoder: text))
    with pytest.raises(ValueError, match=r"layer types .* Use a vLLM server \(server=vllm"):
        check_layer_types(model, "/models/x")


@torch.inference_mode()
def test_rows_join_reorder_and_leave_with_their_states(hybrid):
    """Batched decode steps over rows of different lengths (attention KV left-padded, DeltaNet states stacked);
    every row's logits equal an unbatched forward over its tokens."""
    prompts = _prompts(5, 12, 3, 9)
    rows = [prefill(hybrid, [p])[0][0] for p in prompts]
    kv = BatchKV()
    kv.rebuild([], rows[:2])
    seqs = [list(p) for p in prompts[:2]]
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        if step == 2:  # two rows join, and the running rows swap places
            kv.rebuild([1, 0], rows[2:])
            seqs = [seqs[1], seqs[0]] + [list(p) for p in prompts[2:]]
        if step == 4:  # one row leaves
            kv.rebuild([0, 2, 3], [])
            seqs = [seqs[0], seqs[2], seqs[3]]
        tokens = torch.randint(3, 1000, (kv.batch_size,), generator=g)
        mask, positions = kv.decode_inputs()
        out = hybrid(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=positions,
            cache=kv.cache,
            use_cache=True,
        )
        kv.advance()
        for i, s in enumerate(seqs):
            s.append(int(tokens[i]))
            ref = hybrid(input_ids=torch.tensor([s])).logits[0, -1]
            torch.testing.assert_close(out.logits[i, -1], ref, atol=ATOL, rtol=0)
            assert kv.row(i).length == len(s)


@torch.inference_mode()
def test_a_cached_state_continues_exactly(hybrid):
    """``prefill_tails`` from a prefix's cached row and a chunked scored prefill equal one forward, state too."""
    (prompt,) = _prompts(40)
    whole_rows, whole_logits = prefill(hybrid, [prompt])
    past, _ = prefill(hybrid, [prompt[:17]])
    rows, logits = prefill_tails(hybrid, past, [prompt[17:]])
    torch.testing.assert_close(logits, whole_logits, atol=ATOL, rtol=0)
    row, last, scores = scored_prefill(hybrid, prompt, 3, chunk=7)
    torch.testing.assert_close(last, whole_logits[0], atol=ATOL, rtol=0)
    ref = full_logprobs(hybrid, prompt)
    expected = ref[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(scores.token_logprobs, expected, atol=ATOL, rtol=0)
    for other in (rows[0], row):
        assert other.linear == whole_rows[0].linear and other.length == len(prompt)
        for (a, b), (c, d) in zip(other.layers, whole_rows[0].layers):
            torch.testing.assert_close(a, c, atol=ATOL, rtol=0)
            torch.testing.assert_close(b, d, atol=ATOL, rtol=0)


def test_engine_is_exact_across_batches_and_cached_prefixes(hybrid, hybrid_dir):
    """Round 1: prompts of several lengths (two of one length: one prefill batch) decode in one batch. Round 2,
    while round 1 decodes: prompts extending round-1 prompts (cached-prefix tails of two lengths) and a repeat
    (an exact hit). Each prompt is asked greedily (equal to ``generate``) and sampled (its log-probs equal a full
    forward's)."""
    eos = [hybrid.config.eos_token_id]  # as generate stops
    engine = GenerationEngine(hybrid, eos_token_ids=eos, max_model_len=256, seed=0)
    first = _prompts(3, 11, 11, 30, 57)
    tails = _prompts(6, 6, 13, seed=1)
    second = [first[1] + tails[0], first[3] + tails[1], first[4] + tails[2], first[2]]

    def submit(prompts: list[list[int]]) -> list:
        greedy = SamplingParams(temperature=0.0)
        return [engine.submit(GenerationRequest(p, 16, greedy)) for p in prompts] + [
            engine.submit(GenerationRequest(p, 16, seed=i, ignore_eos=True)) for i, p in enumerate(prompts)
        ]

    handles = submit(first)
    engine.step()
    assert len(engine._running) == 2 * len(first)  # one decode batch
    engine.step()
    handles += submit(second)
    for _ in range(100):
        if all(h.done for h in handles):
            break
        engine.step()
    stats = engine.stats()
    assert stats.prefix_cache_hits_total == len(
        second
    )  # each round-2 prompt once (its two requests share it)
    assert stats.prefill_tokens_total == sum(map(len, first)) + sum(map(len, tails))
    ref = _reference(hybrid_dir)
    n = len(first)
    for p, h in zip(first + second, handles[:n] + handles[2 * n : 2 * n + len(second)]):
        assert h.completions[0].token_ids == greedy_reference(ref, p, 16), len(p)
    for p, h in zip(first + second, handles[n : 2 * n] + handles[2 * n + len(second) :]):
        c = h.completions[0]
        lp = full_logprobs(ref, p + c.token_ids)[len(p) - 1 : -1]
        expected = lp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=ATOL, rtol=0)


# -- the real server over HTTP, on the hybrid and on the MoE --------------------------------------------------
@pytest.fixture(scope="module", params=["qwen3.5", "qwen3-moe"])
def served(request, hybrid_dir, tmp_path_factory):
    """(model directory, its transformers reference, an HTTP client of a server on it, the server's control)."""
    model_dir = (
        hybrid_dir if request.param == "qwen3.5" else Path(resolve_model_path("builtin:tiny-qwen3-moe"))
    )
    cfg = EmbeddedServerConfig(port=0, max_model_len=320, max_num_seqs=8, num_threads=1)
    proc = EmbeddedServerProcess(
        model_dir,
        cfg,
        served_model_name=NAME,
        log_path=tmp_path_factory.mktemp("server") / "server.log",
        startup_timeout=120,
    )
    proc.start()
    control = ServerControl(proc.base_url, timeout=60)
    try:
        with httpx.Client(base_url=proc.base_url, timeout=120) as client:
            yield model_dir, _reference(model_dir), client, control
    finally:
        control.close()
        proc.stop()


def _complete(client: httpx.Client, prompt: list[int], **body) -> dict:
    payload = {
        "model": NAME,
        "prompt": prompt,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        **body,
    }
    resp = client.post("/v1/completions", json=payload)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def _concurrently(fn, items: list) -> list:
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


@pytest.mark.slow
def test_concurrent_greedy_equals_generate(served):
    _, ref, client, _ = served
    prompts = _prompts(1, 4, 9, 9, 23, 64, 150)
    prompts.append(prompts[4] + _prompts(5, seed=2)[0])  # may extend a cached prompt, or be prefilled whole
    outs = _concurrently(lambda p: _complete(client, p, max_tokens=24, temperature=0.0)["token_ids"], prompts)
    for p, out in zip(prompts, outs):
        assert out == greedy_reference(ref, p, 24), len(p)


@pytest.mark.slow
def test_sampled_logprobs_equal_the_trainer_forward(served):
    _, ref, client, _ = served
    prompts = _prompts(2, 17, 17, 48, 100, seed=3)
    choices = _concurrently(
        lambda ip: _complete(
            client, ip[1], max_tokens=32, temperature=1.0, seed=ip[0], logprobs=0, ignore_eos=True
        ),
        list(enumerate(prompts)),
    )
    for p, c in zip(prompts, choices):
        out = c["token_ids"]
        assert len(out) == 32
        lp = full_logprobs(ref, p + out)[len(p) - 1 : -1]
        expected = lp.gather(-1, torch.tensor(out)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c["logprobs"]["token_logprobs"]), expected, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_prompt_logprobs_equal_a_full_forward(served):
    """The distillation teacher's request (``distill/teacher.py``): every prompt token's log-prob and the top 5."""
    _, ref, client, _ = served
    prompts = _prompts(90, 31, seed=4)
    prompts.append(prompts[0] + prompts[1])  # extends a prompt the cache may hold: scored whole all the same
    choices = _concurrently(
        lambda p: _complete(client, p, max_tokens=1, temperature=1.0, prompt_logprobs=5), prompts
    )
    for p, c in zip(prompts, choices):
        lp = full_logprobs(ref, p)
        entries = c["prompt_logprobs"]
        assert len(entries) == len(p) and entries[0] is None
        got = torch.tensor([entries[k][str(p[k])]["logprob"] for k in range(1, len(p))])
        expected = lp[:-1].gather(-1, torch.tensor(p[1:])[:, None])[:, 0]
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        for k in range(1, len(p)):  # the actual token, then the top 5 (values compared: ties may swap ids)
            ids = [int(t) for t in entries[k]]
            assert ids[0] == p[k] and len(ids) in (5, 6)
            values = torch.tensor([entries[k][str(t)]["logprob"] for t in ids])
            torch.testing.assert_close(values, lp[k - 1, ids], atol=ATOL, rtol=0)
            torch.testing.assert_close(values.topk(5).values, lp[k - 1].topk(5).values, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_weight_sync_check_passes_after_an_update(served, tmp_path):
    from transformers import AutoTokenizer

    model_dir, _, _, control = served
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = _reference(model_dir)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    sync = DiskWeightSync(control, tmp_path / "weights")
    cfg = ServerConfig()
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        sync.push(model, 1)
        metrics = verify_weight_sync(cfg, sync, model, tokenizer, 1)
        assert metrics["sync/logprob_gap"] < ATOL and metrics["sync/logprob_gap_max"] < 10 * ATOL
        with torch.no_grad():  # an optimizer step whose weights never reach the server
            model.model.embed_tokens.weight.mul_(3.0)
        with pytest.raises(WeightSyncMismatchError, match="weight sync to version 2 did not take"):
            verify_weight_sync(cfg, sync, model, tokenizer, 2)
        sync.push(model, 2)
        assert verify_weight_sync(cfg, sync, model, tokenizer, 2)["sync/logprob_gap"] < ATOL
    finally:
        model.load_state_dict(original)
        sync.push(model, 3)  # the module's server serves the original weights again
        sync.close()
