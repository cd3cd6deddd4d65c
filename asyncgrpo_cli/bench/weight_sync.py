"""``asyncgrpo bench weight-sync``: seconds per ``nccl`` weight sync and effective GB/s on two GPUs, against a raw
NCCL broadcast of the same bytes in one buffer, timed in the same run over the same NCCL group.

- Sender (this process, ``--sender-gpu``): a Qwen3-shaped model with random bf16 weights and the backend's real
  sender, ``NcclWeightSync.push`` (pause, start, update_weights while broadcasting, finish, resume, over HTTP).
- Receiver (a child process, ``--receiver-gpu``): the embedded server's HTTP routes, engine and
  ``WeightReceiver`` (the receiving code of ``asyncgrpo serve``) around a model of the same shape built in memory
  with other random weights: writing and loading a 1.7B checkpoint would take longer than the benchmark.

Per shape and packed-buffer setting: one push that joins the NCCL group, then ``--syncs`` timed pushes. Reported
medians: the whole push (HTTP control calls included), its transfer phase (``update_weights`` while the broadcast
runs, until both are done), the transfer's effective GB/s, the raw broadcast, and transfer / raw. Last, every
received tensor is checksummed against the sender's.

Usage: asyncgrpo bench weight-sync [--shapes 0.6b,1.7b] [--syncs 5] [--buffer-mb 256,1024] [--num-buffers 2]
       [--unpacked] [--raw-reps 5] [out=PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any

SHAPES = {  # Qwen3-0.6B and Qwen3-1.7B (config.json of the hub checkpoints)
    "0.6b": {"hidden_size": 1024, "intermediate_size": 3072},
    "1.7b": {"hidden_size": 2048, "intermediate_size": 6144},
}


def build_model(shape: str, device: Any, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=151936,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        **SHAPES[shape],
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.to(device).eval().requires_grad_(False)


def checksums(model: Any) -> dict[str, float]:
    import torch

    with torch.no_grad():
        sums = {k: v.double().sum() for k, v in model.state_dict().items()}
        return {k: float(v) for k, v in sums.items()}


def _receiver(shape: str, gpu: int, conn: Any) -> None:
    """The child: the embedded server's app around an in-memory model; then raw broadcasts and checksums."""
    import torch

    from asyncgrpo_cli.config.schema import EmbeddedServerConfig
    from asyncgrpo_cli.embedded.api import ModelContext
    from asyncgrpo_cli.embedded.app import EmbeddedApp, bind
    from asyncgrpo_cli.embedded.engine import GenerationEngine

    try:
        device = torch.device("cuda", gpu)
        torch.cuda.set_device(device)
        model = build_model(shape, device, seed=1)
        engine = GenerationEngine(
            model, eos_token_ids=[], max_model_len=64, max_num_seqs=1, kv_cache_tokens=64, prefix_cache_size=0
        ).start()
        ctx = ModelContext(
            served_name=shape, tokenizer=None, vocab_size=model.config.vocab_size, max_model_len=64
        )
        cfg = EmbeddedServerConfig(dtype="bfloat16", device=str(device))
        app = EmbeddedApp(
            engine=engine, ctx=ctx, model_dir=f"random:{shape}", cfg=cfg, dtype_name=str(model.dtype)
        )
        server = bind("127.0.0.1", 0)
        server.app = app
        server.start()
        conn.send(("ready", server.port))
        while True:
            cmd, arg = conn.recv()
            if cmd == "raw":
                nbytes, reps = arg
                buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
                stream = torch.cuda.current_stream(device)
                for _ in range(reps):
                    app.weight_transfer.communicator.broadcast(buf, src=0, stream=stream)
                stream.synchronize()
                conn.send(("ok", None))
            elif cmd == "checksums":
                conn.send(("ok", checksums(model)))
            else:
                break
        app.stopping.set()
        server.stop()
        engine.shutdown()
    except BaseException as e:  # reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _answer(conn: Any, what: str, timeout: float = 600) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"the receiver did not answer ({what}) within {timeout:g}s")
    status, value = conn.recv()
    if status == "error":
        raise RuntimeError(f"the receiver failed: {value}")
    return value


def raw_broadcast_s(comm: Any, conn: Any, nbytes: int, reps: int) -> list[float]:
    """Seconds of ``reps`` single-buffer broadcasts of ``nbytes`` (after one warm-up), the receiver posting the same."""
    import torch

    buf = torch.empty(nbytes, dtype=torch.uint8, device=comm.device)
    stream = torch.cuda.current_stream(comm.device)
    conn.send(("raw", (nbytes, reps + 1)))
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        comm.broadcast(buf, src=0, stream=stream)
        stream.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    _answer(conn, "raw broadcasts")
    return times


def bench_shape(shape: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import multiprocessing as mp

    import torch

    from asyncgrpo_cli.config.schema import NcclSyncConfig
    from asyncgrpo_cli.server.control import ServerControl
    from asyncgrpo_cli.sync.nccl import NcclWeightSync
    from asyncgrpo_cli.sync.writer import tied_skip

    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(shape, args.receiver_gpu, child_end), daemon=True)
    child.start()
    device = torch.device("cuda", args.sender_gpu)
    torch.cuda.set_device(device)
    rows = []
    try:
        model = build_model(shape, device, seed=0)
        port = _answer(parent, "startup")
        control = ServerControl(f"http://127.0.0.1:{port}", timeout=600)
        skip = tied_skip(model)
        nbytes = sum(t.numel() * t.element_size() for k, t in model.state_dict().items() if k not in skip)
        settings = [(False, 0)] if args.unpacked else [(True, mb) for mb in args.buffer_mb]
        version = 0
        for packed, mb in settings:
            cfg = NcclSyncConfig(
                packed=packed, buffer_size_bytes=max(1, mb) << 20, num_buffers=args.num_buffers
            )
            sync = NcclWeightSync(control, None, None, cfg)
            try:
                version += 1
                sync.push(model, version)  # joins the group, warms up
                pushes = []
                for _ in range(args.syncs):
                    version += 1
                    pushes.append(sync.push(model, version))
                raw = raw_broadcast_s(sync.communicator, parent, nbytes, args.raw_reps)
            finally:
                sync.close()
            total = statistics.median(p["perf/weight_sync_s"] for p in pushes)
            transfer = statistics.median(p["perf/weight_sync_transfer_s"] for p in pushes)
            raw_s = statistics.median(raw)
            rows.append(
                {
                    "shape": shape,
                    "bytes": nbytes,
                    "packed": packed,
                    "buffer": f"{mb} MiB x{args.num_buffers}" if packed else "unpacked",
                    "sync_s": total,
                    "transfer_s": transfer,
                    "transfer_gbps": nbytes / transfer / 1e9,
                    "raw_s": raw_s,
                    "raw_gbps": nbytes / raw_s / 1e9,
                    "transfer_over_raw": transfer / raw_s,
                    "sync_over_raw": total / raw_s,
                    "syncs": [p["perf/weight_sync_s"] for p in pushes],
                }
            )
            print(_row(rows[-1]), flush=True)
        parent.send(("checksums", None))
        theirs = _answer(parent, "checksums")
        mine = checksums(model)
        wrong = [
            k
            for k in mine
            if k not in skip and not math.isclose(theirs[k], mine[k], rel_tol=1e-9, abs_tol=1e-6)
        ]
        if wrong:
            raise RuntimeError(f"{len(wrong)} tensors differ after the syncs, e.g. {wrong[:3]}")
        for row in rows:
            row["checksums_match"] = True
        control.close()
    finally:
        try:
            parent.send(("stop", None))
        except (BrokenPipeError, OSError):
            pass
        child.join(30)
        if child.is_alive():
            child.kill()
    return rows


HEADER = (
    "| shape | GB | buffer | sync s | transfer s | transfer GB/s | raw s | raw GB/s | transfer/raw |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def _row(r: dict[str, Any]) -> str:
    return (
        f"| {r['shape']} | {r['bytes'] / 1e9:.2f} | {r['buffer']} | {r['sync_s']:.4f} | {r['transfer_s']:.4f} "
        f"| {r['transfer_gbps']:.0f} | {r['raw_s']:.4f} | {r['raw_gbps']:.0f} | {r['transfer_over_raw']:.2f}x |"
    )


def _flag(override: str) -> str:
    key, _, value = override.partition("=")
    return f"--{key.replace('_', '-')}={value}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncgrpo bench weight-sync", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="0.6b,1.7b", help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--syncs", type=int, default=5, help="timed pushes per setting (median reported)")
    p.add_argument("--buffer-mb", default="256,1024", help="packed buffer sizes to try, MiB")
    p.add_argument("--num-buffers", type=int, default=2)
    p.add_argument("--unpacked", action="store_true", help="one broadcast per tensor instead")
    p.add_argument("--raw-reps", type=int, default=5)
    p.add_argument("--sender-gpu", type=int, default=0)
    p.add_argument("--receiver-gpu", type=int, default=1)
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    # key=value spellings (out=PATH) as the other benches' overrides
    args = p.parse_args([_flag(a) if "=" in a and not a.startswith("-") else a for a in argv])
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(args.shapes) - set(SHAPES))
    if unknown:
        p.error(f"unknown shapes {unknown}; choose from {sorted(SHAPES)}")
    args.buffer_mb = [int(x) for x in args.buffer_mb.split(",") if x]
    return args


def main(argv: list[str]) -> None:
    import torch

    from asyncgrpo_cli.errors import UserError

    args = parse_args(argv)
    if torch.cuda.device_count() <= max(args.sender_gpu, args.receiver_gpu):
        raise UserError(
            f"asyncgrpo bench weight-sync needs two CUDA devices ({args.sender_gpu} and "
            f"{args.receiver_gpu}); this host has {torch.cuda.device_count()}"
        )
    print(HEADER, flush=True)
    rows = [row for shape in args.shapes for row in bench_shape(shape, args)]
    print("checksums: every received tensor equals the sender's")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.out}")
