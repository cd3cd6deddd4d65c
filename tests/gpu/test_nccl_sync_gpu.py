"""The ``nccl`` weight sync on two GPUs with the real libnccl (no vLLM): the trainer on cuda:0, the embedded
server on cuda:1.

1. the ctypes communicator between two processes: unique-id rendezvous + warm-up, packed and unpacked rounds
   through the sender's and the receiver's code (CUDA streams, rotating buffers);
2. a sync to the embedded server, packed and unpacked: before it the server's log-probs differ from the trainer's,
   after it they are equal; a second sync reuses the group;
3. an update the server refuses while the broadcast is in flight: a clear error within seconds (the NCCL group is
   aborted), and the next push joins a new group and works.

Run: python -m pytest -q -m gpu tests/gpu/test_nccl_sync_gpu.py (about a minute).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import httpx
import pytest
import torch

from asyncgrpo_cli.config.schema import EmbeddedServerConfig, NcclSyncConfig, ServerConfig
from asyncgrpo_cli.nccl.binding import NcclTransport, run_bounded
from asyncgrpo_cli.nccl.wire import TensorMeta, WireParams, receive_tensors, send_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
    ),
]
WIRES = [WireParams(True, 1 << 16, 2), WireParams(True, 1 << 20, 3), WireParams(False)]


def tensors_to_send(device: torch.device) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(1000, 64), (64,), (7,), (256, 256), (3, 5, 7), (0,), (4096,)]
    dtypes = [
        torch.bfloat16,
        torch.float32,
        torch.bfloat16,
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float32,
    ]
    return [
        (f"t{i}", torch.randn(s, generator=g, device=device).to(d))
        for i, (s, d) in enumerate(zip(shapes, dtypes))
    ]


def _receiving_rank(uid: bytes, metas: list[tuple[str, str, tuple[int, ...]]], out) -> None:
    try:
        device = torch.device("cuda", 1)
        torch.cuda.set_device(device)
        comm = NcclTransport().connect(uid, 1, 2, device)
        metas = [TensorMeta(n, getattr(torch, d), s) for n, d, s in metas]
        for wire in WIRES:
            sums: dict[str, torch.Tensor] = {}

            def load(pairs, stream, sums=sums):
                for m, t in pairs:
                    sums[m.name] = t.double().sum()  # on the chunk's stream, after its broadcast

            receive_tensors(comm, metas, wire, load, deadline=time.monotonic() + 60)
            out.put({k: float(v) for k, v in sums.items()})
    except BaseException as e:  # reported to the test
        out.put(f"{type(e).__name__}: {e}")


def test_ctypes_communicator_between_two_processes():
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    tensors = tensors_to_send(device)
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    want = {n: float(t.double().sum()) for n, t in tensors}
    uid = NcclTransport().unique_id()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(
        target=_receiving_rank,
        args=(uid, [(m.name, str(m.dtype).removeprefix("torch."), m.shape) for m in metas], out),
    )
    child.start()
    try:
        comm = run_bounded(lambda: NcclTransport().connect(uid, 0, 2, device), 120, "the rendezvous")
        for wire in WIRES:
            stream = torch.cuda.current_stream(device)  # where the tensors were made
            send_tensors(comm, iter(tensors), metas, wire, wait_for=stream, deadline=time.monotonic() + 60)
            got = out.get(timeout=60)
            assert isinstance(got, dict), got
            assert got == pytest.approx(want, rel=1e-12), wire
        comm.abort()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from asyncgrpo_cli.server.launch import EmbeddedServerProcess

    cfg = EmbeddedServerConfig(
        device="cuda:1", max_model_len=256, max_num_seqs=8, kv_cache_tokens=4096, num_threads=2
    )
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = EmbeddedServerProcess(
        tiny_model_dir, cfg, served_model_name="tiny", log_path=log, startup_timeout=240
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def trainer(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.cuda.set_device(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to("cuda:0")
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def perturb(model, seed: int) -> None:
    g = torch.Generator(device="cuda:0").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device=p.device) * 0.2)


def log_tail(server) -> str:
    return server.log_path.read_text(errors="replace")[-3000:]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_after_a_sync_the_servers_logprobs_are_the_trainers(server, trainer, packed):
    from asyncgrpo_cli.server.control import ServerControl
    from asyncgrpo_cli.server.report import read_server
    from asyncgrpo_cli.sync.nccl import NcclWeightSync
    from asyncgrpo_cli.sync.verify import WeightSyncMismatchError, verify_weight_sync

    model, tokenizer = trainer
    control = ServerControl(server.base_url, timeout=120)
    report = read_server(control)
    assert report.weight_transfer_backend == "nccl" and report.device == "cuda", report
    cfg = NcclSyncConfig(packed=packed, buffer_size_bytes=256 * 1024, timeout=60, init_timeout=60)
    sync = NcclWeightSync(control, None, None, cfg)
    try:
        for version in (1, 2):
            perturb(model, seed=version + (10 if packed else 20))
            with pytest.raises(WeightSyncMismatchError):  # the server still serves the previous weights
                verify_weight_sync(ServerConfig(), sync, model, tokenizer, version)
            timings = sync.push(model, version)
            assert ("perf/weight_sync_init_s" in timings) == (version == 1), timings
            metrics = verify_weight_sync(ServerConfig(), sync, model, tokenizer, version)
            assert metrics["sync/logprob_gap"] < 1e-3 and metrics["sync/logprob_gap_max"] < 1e-2, metrics
            assert control.weight_version() == f"v{version}"
            print(f"packed={packed} v{version}: {timings} gap {metrics['sync/logprob_gap']:.2e}")
    except BaseException:
        print(log_tail(server))
        raise
    finally:
        sync.close()
        control.close()


def test_a_refused_update_fails_fast_and_the_next_push_works(server, trainer):
    from asyncgrpo_cli.server.control import ServerControl
    from asyncgrpo_cli.sync.nccl import NcclSyncError, NcclWeightSync
    from asyncgrpo_cli.sync.verify import verify_weight_sync

    model, tokenizer = trainer
    control = ServerControl(server.base_url, timeout=120)
    sync = NcclWeightSync(control, None, None, NcclSyncConfig(timeout=60, init_timeout=60))
    try:
        perturb(model, seed=3)
        model.register_buffer("bogus", torch.zeros(3, device="cuda:0"))  # a tensor the server does not have
        t0 = time.monotonic()
        with pytest.raises(NcclSyncError, match="'bogus' is not a tensor of the served model"):
            sync.push(model, 1)
        assert time.monotonic() - t0 < 30
        del model._buffers["bogus"]
        timings = sync.push(model, 2)
        assert "perf/weight_sync_init_s" in timings  # a new NCCL group after the aborted one
        assert verify_weight_sync(ServerConfig(), sync, model, tokenizer, 2)["sync/logprob_gap"] < 1e-3
        assert httpx.get(server.base_url + "/is_paused", timeout=30).json() == {"is_paused": False}
    except BaseException:
        print(log_tail(server))
        raise
    finally:
        sync.close()
        control.close()
