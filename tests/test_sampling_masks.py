"""Top-k / top-p / min-p candidate sets ("sampling masks") end to end, on plain data and a small model (no server):

the embedded sampler's masks against its own filters, the ``/inference/v1/generate`` request / response shapes,
the client's parsing and cap, the compact representation, turns -> samples -> packed rows (sequence and tree),
the trainer's renormalized log-probs against full logits masked by hand, the loss metric, and the startup probe's
findings on ``ServerReport`` data. The server-backed checks live in ``test_sampling_masks_server.py``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from asyncgrpo_cli.config.compose import compose_config
from asyncgrpo_cli.config.schema import PackingConfig
from asyncgrpo_cli.embedded.api import ApiError, ModelContext
from asyncgrpo_cli.embedded.generate import build_generate_response, parse_generate_request
from asyncgrpo_cli.embedded.requests import Completion
from asyncgrpo_cli.embedded.sampling import BatchParams, SamplingParams, processed_logprobs, sample
from asyncgrpo_cli.errors import ConfigError
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.packing.tree import TreePacker
from asyncgrpo_cli.rollout.client import (
    SamplingParams as ClientParams,
)
from asyncgrpo_cli.rollout.client import (
    ServerRequestError,
    build_generate_payload,
    parse_generate_choice,
)
from asyncgrpo_cli.rollout.sequences import rollout_to_sequences
from asyncgrpo_cli.samples import SAMPLER_TOPK, CandidateSets, Rollout, TopK, TrainingSequence, TurnRecord
from asyncgrpo_cli.server.mask_support import resolve_sampling_mask
from asyncgrpo_cli.server.probe import find_problems, fix_command
from asyncgrpo_cli.server.report import ServerReport
from asyncgrpo_cli.train.losses import ScoreCenteringLoss, finalize_metrics
from asyncgrpo_cli.train.step import forward_backward

NEG_INF = float("-inf")


# ---------------------------------------------------------------- the compact representation
def test_candidate_sets_cap_validity_take_concat_and_padding():
    sets = CandidateSets.from_lists(
        [[1, 2, 3], [4], None, [5, 6, 7, 8, 9], [7, 8]], max_size=4, sampled=[2, 4, 0, 5, 9]
    )
    # the 5-id set is over the cap; [7, 8] does not hold the sampled 9; None is "not truncated"
    assert sets.to_lists() == [[1, 2, 3], [4], [], [], []]
    assert (sets.num_overflow, sets.num_invalid, sets.num_with_set) == (1, 1, 2)
    assert sets.ids.dtype == np.int32 and sets.offsets.tolist() == [0, 3, 4, 4, 4, 4]
    assert sets.take([1, 2, 0]).to_lists() == [[4], [], [1, 2, 3]]
    both = CandidateSets.concat([sets.take([0]), CandidateSets.empty(2), sets.take([1])])
    assert both.to_lists() == [[1, 2, 3], [], [], [4]]
    assert both.padded().tolist() == [[1, 2, 3], [-1, -1, -1], [-1, -1, -1], [4, -1, -1]]
    assert CandidateSets.coerce([[3], []]).to_lists() == [[3], []]
    assert CandidateSets.empty(3).padded().shape == (3, 0)
    with pytest.raises(ValueError, match="offsets"):
        CandidateSets(np.array([1, 2]), np.array([0, 1]))


# ---------------------------------------------------------------- the sampler's masks
FILTERS = [
    dict(top_k=7),
    dict(top_p=0.6),
    dict(min_p=0.2),
    dict(top_k=12, top_p=0.9, temperature=0.7),
    dict(min_p=0.05, top_k=20, top_p=0.8, temperature=1.3),
    dict(top_p=0.95, repetition_penalty=1.3),
]


@pytest.mark.parametrize("kw", FILTERS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_mask_is_the_support_of_the_filtered_distribution(kw):
    vocab, rows = 64, 6
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, vocab, generator=gen) * 2.5
    params = BatchParams.build([SamplingParams(**kw)] * rows, vocab)
    seen = torch.rand(rows, vocab, generator=gen) < 0.3 if params.use_penalty else None
    expected = processed_logprobs(logits, params, seen).double().exp() > 0  # nonzero filtered probability
    for draw in range(20):
        gens = [torch.Generator().manual_seed(100 * draw + i) for i in range(rows)]
        out = sample(logits, params, gens, seen=seen, want_masks=[True] * rows)
        for i in range(rows):
            mask = out.sampling_masks[i]
            assert mask is not None and mask.dtype == np.int32
            assert mask.tolist() == torch.nonzero(expected[i]).squeeze(1).tolist()  # ascending ids
            assert int(out.token_ids[i]) in mask.tolist()
            assert 0 < len(mask) < vocab
    if kw == dict(top_k=7):  # ties are measure-zero for random logits: exactly the 7 largest
        assert set(mask.tolist()) == set(logits[rows - 1].topk(7).indices.tolist())


def test_no_mask_for_unwanted_greedy_or_untruncated_rows():
    logits = torch.randn(4, 32)
    params = BatchParams.build(
        [
            SamplingParams(top_k=5),
            SamplingParams(top_k=5, temperature=0.0),
            SamplingParams(),
            SamplingParams(top_k=5),
        ],
        32,
    )
    out = sample(logits, params, [None] * 4, want_masks=[True, True, True, False])
    assert [m is None for m in out.sampling_masks] == [False, True, True, True]
    assert sample(logits, params, [None] * 4).sampling_masks is None
    ranks = (processed_logprobs(logits, params) > out.logprobs[:, None]).sum(1) + 1
    assert out.ranks.tolist() == ranks.tolist()


# ---------------------------------------------------------------- /inference/v1/generate on plain data
CTX = ModelContext(served_name="tiny", tokenizer=None, vocab_size=100, max_model_len=64)

# vLLM 0.32's GenerateTokensResponse / GenerateTokensChoice / GenerateLogProbsContent fields
# (vllm/entrypoints/scale_out/token_in_token_out/protocol.py)
VLLM_RESPONSE_KEYS = {
    "request_id", "model", "created", "usage", "prompt_logprobs", "prompt_token_id_logprobs", "prompt_token_ids",
    "mm_placeholders", "metrics", "kv_transfer_params", "ec_transfer_params", "output_mode", "choices",
}  # fmt: skip
VLLM_CHOICE_KEYS = {
    "index", "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask", "weight_versions",
    "logprobs",
}  # fmt: skip


def _request(**sp) -> dict:
    return {
        "model": "tiny",
        "token_ids": [5, 6],
        "sampling_params": {"max_tokens": 2, **sp},
        "request_id": "r1",
    }


def test_generate_request_parsing():
    plan = parse_generate_request(_request(top_k=5, top_p=0.9, logprobs=2, seed=3, detokenize=False), CTX)
    req = plan.request
    assert (req.prompt_ids, req.max_tokens, req.seed, req.num_logprobs, req.return_sampling_mask) == (
        [5, 6], 2, 3, 2, True,
    )  # fmt: skip
    assert (req.params.top_k, req.params.top_p, plan.logprobs, plan.request_id) == (5, 0.9, 2, "r1")
    assert parse_generate_request(_request(), CTX).logprobs is None


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"token_ids": [5], "sampling_params": {}, "model": "x"}, 404, "The model `x` does not exist."),
        ({"token_ids": [], "sampling_params": {}}, 400, "token_ids must be a non-empty array"),
        ({"token_ids": [5, 100], "sampling_params": {}}, 400, "Token id 100 is out of vocabulary"),
        ({"token_ids": [5]}, 400, "sampling_params is required"),
        (
            {"token_ids": [5], "sampling_params": {"topk": 3}},
            400,
            "sampling_params.topk is not a SamplingParams",
        ),
        ({"token_ids": [5], "sampling_params": {"min_tokens": 2}}, 400, "min_tokens=2 is not supported"),
        ({"token_ids": [5], "sampling_params": {"logprobs": 21}}, 400, "greater than max allowed: 20"),
        ({"token_ids": [5], "sampling_params": {}, "output_mode": "text"}, 400, "output_mode='text'"),
        ({"token_ids": [5], "sampling_params": {}, "stream": True}, 400, "stream=true"),
        ({"token_ids": [5], "sampling_params": {"max_tokens": 64}}, 400, "maximum context length is 64"),
    ],
)
def test_generate_request_rejections(body, status, fragment):
    with pytest.raises(ApiError) as e:
        parse_generate_request(body, CTX)
    assert e.value.status == status and fragment in e.value.message


def test_generate_response_has_vllms_shape_with_sampling_masks():
    plan = parse_generate_request({**_request(top_k=3, logprobs=2), "return_token_ids": True}, CTX)
    c = Completion(
        token_ids=[10, 11],
        logprobs=[-1.0, float("-inf")],
        top=[[(12, -0.5), (10, -1.0)], [(13, -0.1), (14, -20000.0)]],
        ranks=[2, 3],
        sampling_mask=[np.array([10, 12, 40], np.int32), np.array([11, 13, 14], np.int32)],
        finish_reason="length",
    )
    data = build_generate_response(plan, [c], CTX)
    assert set(data) == VLLM_RESPONSE_KEYS
    assert data["request_id"] == "generate-tokens-r1" and data["output_mode"] == "tokens"
    assert data["prompt_token_ids"] == [5, 6] and data["usage"]["completion_tokens"] == 2
    (choice,) = data["choices"]
    assert set(choice) == VLLM_CHOICE_KEYS
    assert choice["token_ids"] == [10, 11] and choice["finish_reason"] == "length"
    assert choice["sampling_mask"] == [[10, 12, 40], [11, 13, 14]]  # one list of ints per generated token
    first, second = choice["logprobs"]["content"]
    assert (first["token_id"], first["logprob"], first["rank"]) == (10, -1.0, 2)
    # sampled token first, then the top N without repeating it (N or N + 1 entries); -inf clamped to -9999
    assert first["top_logprobs"] == [
        {"token_id": 10, "logprob": -1.0, "rank": 2},
        {"token_id": 12, "logprob": -0.5, "rank": 1},
    ]
    assert [e["token_id"] for e in second["top_logprobs"]] == [11, 13, 14]
    assert second["logprob"] == -9999.0 and second["top_logprobs"][2]["logprob"] == -9999.0
    untruncated = Completion(
        token_ids=[7], logprobs=[-2.0], ranks=[1], sampling_mask=[None], finish_reason="stop"
    )
    choice = build_generate_response(parse_generate_request(_request(), CTX), [untruncated], CTX)["choices"][
        0
    ]
    assert choice["sampling_mask"] is None and choice["logprobs"] is None


# ---------------------------------------------------------------- the client
def test_client_payload_and_choice_parsing_with_the_cap():
    p = ClientParams(max_tokens=8, temperature=0.9, top_k=4, top_p=0.95, num_logprobs=2)
    payload = build_generate_payload("tiny", [1, 2], p, seed=7)
    assert payload["token_ids"] == [1, 2] and payload["output_mode"] == "tokens"
    assert payload["sampling_params"] == {
        "n": 1, "max_tokens": 8, "temperature": 0.9, "logprobs": 2, "skip_special_tokens": False,
        "detokenize": False, "top_p": 0.95, "top_k": 4, "seed": 7,
    }  # fmt: skip
    choice = {
        "token_ids": [10, 11, 12],
        "finish_reason": "stop",
        "sampling_mask": [[3, 10], [11, 20, 21, 22, 23], [9]],
        "logprobs": {
            "content": [
                {"token_id": 10, "logprob": -0.7, "top_logprobs": [{"token_id": 10, "logprob": -0.7},
                                                                   {"token_id": 3, "logprob": -0.6}]},
                {"token_id": 11, "logprob": -1.5, "top_logprobs": [{"token_id": 11, "logprob": -1.5}]},
                {"token_id": 12, "logprob": -0.1, "top_logprobs": []},
            ]
        },
    }  # fmt: skip
    turn = parse_generate_choice([1, 2], choice, want_topk=True, max_mask_candidates=4)
    assert turn.output_ids == [10, 11, 12] and turn.output_log_probs == [-0.7, -1.5, -0.1]
    assert turn.output_sampler_logprobs[0] == {10: -0.7, 3: -0.6}
    sets = turn.output_sampling_mask
    assert sets.to_lists() == [[3, 10], [], []]  # 5 ids > cap 4; [9] lacks the sampled 12
    assert (sets.num_overflow, sets.num_invalid) == (1, 1)
    choice["sampling_mask"] = None
    assert parse_generate_choice([1, 2], choice, True, 4).output_sampling_mask is None
    choice["sampling_mask"] = [[10]]
    with pytest.raises(ServerRequestError, match="1 sampling masks for 3 tokens"):
        parse_generate_choice([1, 2], choice, True, 4)


# ---------------------------------------------------------------- turns -> samples -> packed rows
def test_sequences_keep_one_set_per_trained_token_across_turns_and_forks():
    t1 = TurnRecord(
        [1, 2],
        [10, 11, 12],
        [-1.0] * 3,
        output_mask=[1, 0, 1],
        output_sampling_mask=CandidateSets.from_lists([[10, 4], [11], [12, 5, 6]]),
    )
    t2 = TurnRecord([1, 2, 10, 11, 12, 7], [13, 14], [-1.0] * 2)  # extends; no sets recorded
    t3 = TurnRecord([9, 9], [15], [-1.0], output_sampling_mask=[[15, 16]])  # a fork; nested lists accepted
    samples, stats = rollout_to_sequences(Rollout([], [], [t1, t2, t3]), num_topk=0)
    assert stats.forks == 1 and len(samples) == 2
    first, second = samples
    assert first.num_trained == 4 and first.sampling_mask.to_lists() == [[10, 4], [12, 5, 6], [], []]
    assert second.sampling_mask.to_lists() == [[15, 16]]
    plain, _ = rollout_to_sequences(Rollout([], [], [t2]), num_topk=0)
    assert plain[0].sampling_mask is None


def _sample(ids, n_prompt, sets, group=0, seq=0) -> TrainingSequence:
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.arange(len(ids)) >= n_prompt
    return TrainingSequence(
        input_ids=ids,
        train_mask=mask,
        sampler_logprobs=np.where(mask, -1.0, 0.0).astype(np.float32),
        sampling_mask=None if sets is None else CandidateSets.from_lists(sets),
        group_id=group,
        prompt_seq=seq,
    )


def _tree_samples() -> list[TrainingSequence]:
    """Two groups; group 0 shares its prompt, holds an identical pair of completions and one without sets."""
    return [
        _sample([1, 2, 3, 4, 5], 3, [[4, 7], [5, 8, 9]]),
        _sample([1, 2, 3, 4, 6], 3, [[4, 7, 11], [6]]),
        _sample([1, 2, 3, 4, 5], 3, [[4], [5, 9]]),  # same tokens as the first, other sets (another branch)
        _sample([1, 2, 3, 7, 7], 3, None),
        _sample([20, 21, 22], 1, [[21, 23], [22, 24, 25, 26]], group=1, seq=1),
    ]


@pytest.mark.parametrize("packer", [SequencePacker, TreePacker])
def test_packers_carry_support_ids_aligned_with_targets(packer):
    row = packer(PackingConfig()).pack(_tree_samples())
    assert row.target_ids.tolist() == [4, 5, 4, 6, 4, 5, 7, 7, 21, 22]
    assert row.support_ids.tolist() == [
        [4, 7, -1, -1], [5, 8, 9, -1],
        [4, 7, 11, -1], [6, -1, -1, -1],
        [4, -1, -1, -1], [5, 9, -1, -1],
        [-1, -1, -1, -1], [-1, -1, -1, -1],
        [21, 23, -1, -1], [22, 24, 25, 26],
    ]  # fmt: skip
    live = row.support_ids >= 0
    has = live.any(1)
    assert ((row.support_ids == row.target_ids[:, None]) & live).any(1).tolist() == has.tolist()
    moved = row.to("cpu")
    assert torch.equal(moved.support_ids, row.support_ids)
    if packer is TreePacker:  # the shared prompt is forwarded once; the branches keep their own sets
        assert row.num_forwarded < row.num_unpacked


def test_rows_without_sets_have_no_support_and_mismatches_are_named():
    row = SequencePacker(PackingConfig()).pack([_sample([1, 2, 3], 1, None)])
    assert row.support_ids is None
    bad = _sample([1, 2, 3], 1, [[2]])  # 2 trained tokens, 1 set
    with pytest.raises(ValueError, match="2 trained tokens but 1 candidate sets"):
        SequencePacker(PackingConfig()).pack([bad])


# ---------------------------------------------------------------- the trainer's renormalized log-probs
@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).float()


class _Capture:
    """A loss that records the head's statistics (and the row) and trains nothing."""

    needs = (SAMPLER_TOPK,)

    def __call__(self, stats, row, num_trained):
        self.stats, self.row = stats, row
        return stats.logprobs.sum() * 0.0, {}


def _reference(model, samples, temperature):
    """Stock forwards (full logits): log-softmax after setting every logit outside the token's set to -inf."""
    lps, ents, tops = [], [], []
    for s in samples:
        logits = model(input_ids=torch.from_numpy(s.input_ids)[None], use_cache=False).logits[0].float()
        t = np.flatnonzero(s.train_mask)
        z = logits[torch.from_numpy(t - 1)] / temperature
        sets = s.sampling_mask or CandidateSets.empty(len(t))
        for i in range(len(t)):
            if len(sets[i]):
                outside = torch.ones(z.shape[1], dtype=torch.bool)
                outside[torch.from_numpy(sets[i].astype(np.int64))] = False
                z[i] = z[i].masked_fill(outside, NEG_INF)
        logp = torch.log_softmax(z, -1)
        lps.append(logp.gather(1, torch.from_numpy(s.input_ids[t])[:, None]).squeeze(1))
        ents.append(-torch.special.xlogy(logp.exp(), logp.exp()).sum(1))
        tops.append(logp.gather(1, torch.from_numpy(s.token_extras[SAMPLER_TOPK].ids).clamp(min=0)))
    return torch.cat(lps), torch.cat(ents), torch.cat(tops)


@pytest.mark.parametrize("packer", [SequencePacker, TreePacker])
def test_trainer_logprobs_are_renormalized_over_the_candidate_sets(llama, packer):
    samples = _tree_samples()
    for s in samples:  # the sampler's top-3 at each trained token: ids inside and outside the sets
        ids = np.tile(np.array([[4, 7, 30]], dtype=np.int64), (s.num_trained, 1))
        s.token_extras[SAMPLER_TOPK] = TopK(ids, np.full(ids.shape, -1.0, dtype=np.float32))
    capture = _Capture()
    with torch.no_grad():
        ref_lp, ref_ent, ref_top = _reference(llama, samples, temperature=0.8)
    forward_backward(llama, [samples], 10, packer(PackingConfig()), capture, torch.device("cpu"), 0.8)
    stats = capture.stats
    torch.testing.assert_close(stats.logprobs.detach(), ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(stats.entropy, ref_ent, atol=2e-5, rtol=0)
    finite = ref_top.isfinite()
    assert torch.equal(stats.topk_logprobs.isfinite(), finite)  # ids outside a token's set: -inf
    torch.testing.assert_close(stats.topk_logprobs.detach()[finite], ref_top[finite], atol=2e-5, rtol=0)
    # renormalization raises every truncated token's log-prob above its full-vocabulary value
    with torch.no_grad():
        full, _, _ = _reference(llama, [TrainingSequence(**{**s.__dict__, "sampling_mask": None}) for s in samples],
                                temperature=0.8)  # fmt: skip
    has = (capture.row.support_ids >= 0).any(1)
    assert (ref_lp[has] > full[has]).all() and torch.equal(ref_lp[~has], full[~has])


def test_loss_reports_the_renormalized_fraction():
    from asyncgrpo_cli.config.schema import LossConfig
    from asyncgrpo_cli.model.logprobs import TokenStats

    row = SequencePacker(PackingConfig()).pack(_tree_samples())
    n = row.num_trained
    stats = TokenStats(torch.full((n,), -1.0), torch.zeros(n), torch.zeros(n, 0))
    row.extras = {SAMPLER_TOPK: TopK(torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, 0))}
    _, raw = ScoreCenteringLoss(LossConfig())(stats, row, n)
    assert finalize_metrics(raw)["sampling/sampling_mask_frac"] == pytest.approx(8 / 10)
    row.support_ids = None
    _, raw = ScoreCenteringLoss(LossConfig())(stats, row, n)
    assert "sampling/sampling_mask_frac" not in finalize_metrics(raw)


# ---------------------------------------------------------------- config and the startup probe
def test_config_keys_are_validated():
    cfg = compose_config(["+recipe=tiny"])
    assert (cfg.sampling.sampling_mask, cfg.sampling.max_mask_candidates, cfg.sampling.truncates) == (
        "auto", 1024, False,
    )  # fmt: skip
    assert compose_config(["+recipe=tiny", "sampling.top_p=0.9"]).sampling.truncates
    assert not compose_config(
        ["+recipe=tiny", "sampling.top_k=5", "sampling.temperature=0"]
    ).sampling.truncates
    with pytest.raises(
        ConfigError, match="sampling.sampling_mask .'always'. must be one of auto, required, off"
    ):
        compose_config(["+recipe=tiny", "sampling.sampling_mask=always"])
    with pytest.raises(ConfigError, match="sampling.max_mask_candidates"):
        compose_config(["+recipe=tiny", "sampling.max_mask_candidates=0"])


def _vllm(**kw) -> ServerReport:
    base = dict(base_url="http://x", model_ids=["m"], max_model_len=4096, dev_routes=True, logprobs_mode=
                "processed_logprobs", max_logprobs=20, device="cuda", weight_transfer_backend=None)  # fmt: skip
    return ServerReport(**{**base, **kw})


def _cfg(*overrides):
    return compose_config(["+recipe=tiny", "server=vllm", *overrides])


def test_probe_requires_both_vllm_flags_only_when_masks_are_required():
    bare = _vllm(return_sampling_mask=False, generate_route="disabled")
    required = _cfg("sampling.top_k=64", "sampling.sampling_mask=required")
    problems = find_problems(bare, required)
    whats = [p.what for p in problems]
    assert any("without --enable-scale-out" in w for w in whats) and any(
        "--return-sampling-mask" in w for w in whats
    )
    assert sorted(f for p in problems for f in p.flags) == ["--enable-scale-out", "--return-sampling-mask"]
    assert all(w.startswith("sampling.sampling_mask=required: ") for w in whats)
    command = fix_command(bare, required, model_path="/m")
    assert "--return-sampling-mask" in command and "--enable-scale-out" in command
    assert find_problems(bare, _cfg("sampling.top_k=64")) == []  # auto: best effort (warned at startup)
    assert find_problems(bare, _cfg("sampling.sampling_mask=required")) == []  # nothing truncates
    old = _vllm(return_sampling_mask=None, generate_route="missing")
    assert "vLLM >= 0.28" in find_problems(old, required)[0].what
    cpu = [
        p for p in find_problems(_vllm(device="cpu", generate_route="enabled"), required) if "mask" in p.what
    ]
    assert len(cpu) == 1 and "CPU build cannot return sampling masks" in cpu[0].what
    assert "server=embedded" in cpu[0].config_fix


def test_probe_names_requests_a_mask_recording_vllm_rejects():
    ready = _vllm(return_sampling_mask=True, generate_route="enabled")
    assert find_problems(ready, _cfg("sampling.top_k=64", "sampling.sampling_mask=required")) == []
    problems = find_problems(ready, compose_config(["+recipe=tiny", "server=vllm", "sampling.top_p=0.9"]))
    fixes = {p.config_fix for p in problems}
    assert any(f.startswith("sampling.top_k=N") for f in fixes)
    assert "server.verify_sync=false" not in fixes  # the weight-sync probe is a request it replays
    launch = find_problems(
        _vllm(return_sampling_mask=False, generate_route="disabled"),
        _cfg("server=vllm_launch", "sampling.top_k=8", "sampling.sampling_mask=required"),
    )
    launch = [p for p in launch if p.what.startswith("sampling.sampling_mask=required")]
    assert (
        len(launch) == 2
        and launch[0].config_fix
        == "server.vllm_launch.extra_args=[--return-sampling-mask,--enable-scale-out]"
    )


def test_resolution_uses_masks_or_warns_once_with_the_fix(caplog):
    embedded = ServerReport("http://e", ["tiny"], 256, True, embedded=True, return_sampling_mask=True,
                            generate_route="enabled")  # fmt: skip
    bare = _vllm(return_sampling_mask=False, generate_route="disabled")
    with caplog.at_level(logging.WARNING, logger="asyncgrpo_cli.server.mask_support"):
        assert resolve_sampling_mask(embedded, _cfg("sampling.top_k=8"))
        assert not resolve_sampling_mask(embedded, _cfg())  # nothing truncates: nothing to ask for
        assert not caplog.records
        assert not resolve_sampling_mask(embedded, _cfg("sampling.top_k=8", "sampling.sampling_mask=off"))
        assert not resolve_sampling_mask(bare, _cfg("sampling.top_k=8"))
    off, bare_warning = (r.getMessage() for r in caplog.records)
    assert "sampling.sampling_mask=off" in off and "biased" in off
    assert (
        "biased" in bare_warning
        and "restart vLLM with --enable-scale-out --return-sampling-mask" in bare_warning
    )
