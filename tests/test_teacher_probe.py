"""The teacher probe (``distill/probe.py``) against embedded teachers: the student's own model passes; a teacher
with another vocabulary, one whose vocabulary is a prefix of the student's, a ``teacher.top_k`` above the server's
cap and a ``max_model_len`` too short for the student's sequences are refused with one message naming the teacher
and the fix. A stdlib fake teacher without ``/server_info`` has its cap checked by a scoring request, and gets the
``vllm serve`` command; a dead port fails within ``teacher.startup_timeout``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from asyncgrpo_cli.config.schema import EmbeddedServerConfig
from asyncgrpo_cli.distill.probe import PROBE_TEXT, probe_ids, probe_teacher, tokenizer_mismatch
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.model import tiny
from asyncgrpo_cli.server.launch import EmbeddedServerProcess
from tests.test_teacher import FakeTeacher, free_port

NAME = "tiny"
MAX_MODEL_LEN = 256
SMALL_VOCAB = 900
"""Rows of the prefix-vocabulary teacher: above every id of the probe text, below the student's 1024."""


def start_teacher(model_dir: Path, log_dir: Path) -> EmbeddedServerProcess:
    cfg = EmbeddedServerConfig(port=0, max_model_len=MAX_MODEL_LEN, max_num_seqs=2, num_threads=1)
    proc = EmbeddedServerProcess(
        model_dir, cfg, served_model_name=NAME, log_path=log_dir / "server.log", startup_timeout=120
    )
    proc.start()
    return proc


@pytest.fixture(scope="module")
def student_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def same(tiny_model_dir, tmp_path_factory):
    proc = start_teacher(tiny_model_dir, tmp_path_factory.mktemp("same"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory):
    """A tiny model whose byte-level BPE was trained on other words: the same size and specials, other merges."""
    rng = random.Random(1)
    words = ["".join(rng.choice("zyxwvutsrqponmlkj") for _ in range(rng.randint(2, 7))) for _ in range(400)]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(3000)]
    dest = tmp_path_factory.mktemp("other-vocab") / "model"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny, "_corpus", lambda: lines)
        tiny.build_tiny_qwen3(dest, seed=1, hidden_size=64)
    proc = start_teacher(dest, dest.parent)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def prefix_vocab(tiny_model_dir, student_tokenizer, tmp_path_factory):
    """The student's tokenizer on a model of SMALL_VOCAB rows: every id it knows decodes as the student's does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.vocab_size = SMALL_VOCAB
    config.hidden_size, config.intermediate_size = 64, 128
    dest = tmp_path_factory.mktemp("prefix-vocab") / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(dest)
    student_tokenizer.save_pretrained(dest)
    proc = start_teacher(dest, dest.parent)
    yield proc
    proc.stop()


def probe(url: str, tokenizer, *, top_k: int = 8, need_len: int = MAX_MODEL_LEN - 1, startup_timeout=30.0):
    return probe_teacher(
        "default",
        url,
        tokenizer,
        top_k=top_k,
        need_len=need_len,
        startup_timeout=startup_timeout,
        timeout=30.0,
    )


def test_probe_text_covers_digits_punctuation_non_ascii_and_special_tokens(student_tokenizer):
    ids = probe_ids(student_tokenizer)
    assert max(ids) < SMALL_VOCAB
    text = student_tokenizer.decode(ids)
    assert PROBE_TEXT in text and "<|im_start|>system" in text and text.endswith("<|im_end|>")
    assert {1, 2} <= set(ids)  # <|im_start|>, <|im_end|>


def test_the_students_own_model_passes(same, student_tokenizer):
    report = probe(same.base_url, student_tokenizer)
    assert report.teacher_id == "default" and report.url == same.base_url and report.model == NAME
    assert report.embedded and report.max_model_len == MAX_MODEL_LEN and report.max_logprobs == 20
    assert report.logprobs_mode == "processed_logprobs"
    assert probe(same.base_url, student_tokenizer, top_k=20).max_logprobs == 20  # at the cap


def test_max_model_len_too_short_for_the_students_sequences(same, student_tokenizer):
    with pytest.raises(UserError) as err:
        probe(same.base_url, student_tokenizer, need_len=MAX_MODEL_LEN)
    msg = str(err.value)
    assert msg.startswith(f"teacher 'default' at {same.base_url} (teacher.servers.default) cannot score")
    assert (
        f"max_model_len is {MAX_MODEL_LEN}: scoring the student's longest sequence ({MAX_MODEL_LEN} tokens, its "
        f"max_model_len) needs {MAX_MODEL_LEN + 1} positions" in msg
    )
    assert f"(fix: teacher.embedded.max_model_len={MAX_MODEL_LEN + 1})" in msg
    assert len(msg.splitlines()) == 2  # the only problem: the tokenizer and the cap passed


def test_top_k_above_the_servers_cap(same, student_tokenizer):
    with pytest.raises(
        UserError,
        match=r"--max-logprobs is 20, below teacher.top_k=21 \(fix: lower teacher.top_k to 20, the embedded",
    ):
        probe(same.base_url, student_tokenizer, top_k=21)


def test_another_vocabulary_is_refused(other_vocab, student_tokenizer):
    with pytest.raises(UserError) as err:
        probe(other_vocab.base_url, student_tokenizer)
    msg = str(err.value)
    assert (
        "it does not share the student's tokenizer: token id 456 (probe position 1) is 'system' to the student "
        "but ' kyj' to it" in msg
    )
    assert "trains the student toward wrong tokens" in msg
    assert "at teacher.servers.default" in msg and "vllm serve" not in msg  # no flag fixes a vocabulary


def test_a_smaller_vocabulary_is_refused_by_the_largest_id(prefix_vocab, student_tokenizer):
    ids = probe_ids(student_tokenizer)
    with pytest.raises(UserError) as err:
        probe(prefix_vocab.base_url, student_tokenizer)
    msg = str(err.value)
    assert "it refused the student's largest token id 1023" in msg
    assert "Token id 1023 is out of vocabulary" in msg and "its vocabulary is smaller" in msg
    # the probe text alone cannot tell: every id in it decodes the same on this teacher
    assert max(ids) < SMALL_VOCAB


def test_tokenizer_mismatch_names_the_first_differing_token(student_tokenizer):
    ids = [1, 456, 201]
    good = [None] + [{str(t): {"decoded_token": student_tokenizer.decode([t])}} for t in ids[1:]]
    assert tokenizer_mismatch(good, ids, student_tokenizer) is None
    bad = [None, good[1], {"201": {"decoded_token": "\n"}, "300": {"decoded_token": "nope"}}]
    text = student_tokenizer.decode([300])
    assert tokenizer_mismatch(bad, ids, student_tokenizer) == (
        f"token id 300 (probe position 2) is {text!r} to the student but 'nope' to it"
    )
    larger = [None, good[1], {"201": {"decoded_token": "\n"}, "5000": {"decoded_token": "x"}}]
    assert "token id 5000 at probe position 2, beyond the student's vocabulary of 1024" in tokenizer_mismatch(
        larger, ids, student_tokenizer
    )


def test_an_unreported_cap_is_checked_by_a_scoring_request(student_tokenizer):
    decode = lambda t: student_tokenizer.decode([t])  # noqa: E731
    with FakeTeacher(decode=decode, max_logprobs=20, max_model_len=4096) as srv:
        report = probe(srv.base_url, student_tokenizer, need_len=2048)
        assert report.max_logprobs is None and not report.embedded and report.model == "fake"
        with pytest.raises(UserError) as err:
            probe(srv.base_url, student_tokenizer, top_k=32, need_len=4096)
    lines = str(err.value).splitlines()
    assert (
        lines[0]
        == f"teacher 'default' at {srv.base_url} (teacher.servers.default) cannot score for this run:"
    )
    assert lines[1].startswith("  - max_model_len is 4096: ") and lines[1].endswith(
        "(fix: --max-model-len 4097)"
    )
    assert lines[2] == (
        "  - it refused prompt_logprobs=32: Requested prompt logprobs of 32, which is greater than max allowed: 20 "
        "(fix: --max-logprobs -1, or lower teacher.top_k)"
    )
    assert lines[3:] == [
        "Restart the teacher with (every fix applied):",
        f"  vllm serve fake --port {srv.port} --max-model-len 4097 --max-logprobs -1",
    ]


def test_an_unreachable_teacher_fails_within_the_startup_timeout(student_tokenizer):
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(UserError) as err:
        probe(url, student_tokenizer, startup_timeout=1.0)
    assert time.monotonic() - t0 < 5.0
    msg = str(err.value)
    assert msg.startswith(
        f"teacher 'default' at {url} (teacher.servers.default): it did not answer GET /health"
    )
    assert "teacher.startup_timeout=1s" in msg and "fix teacher.servers.default" in msg


def test_check_probe_server_probes_every_running_teacher(same, other_vocab):
    """`asyncgrpo check --probe-server` probes the teachers of a distillation config, not only the student."""
    import os
    import subprocess
    import sys

    def check(url: str) -> subprocess.CompletedProcess:
        args = ["check", "+recipe=distill_tiny", f"teacher.servers.default={url}", "--probe-server"]
        env = {**os.environ, "COLUMNS": "300"}
        cmd = [sys.executable, "-m", "asyncgrpo_cli", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)

    ok = check(same.base_url)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert f"teacher 'default' at {same.base_url}" in ok.stdout and "the student's tokenizer" in ok.stdout
    assert "the embedded server is started by train" in ok.stdout  # the student: nothing to probe yet
    bad = check(other_vocab.base_url)
    assert bad.returncode == 2 and "teacher 'default'" in bad.stderr, bad.stderr[-2000:]
