"""The ``nccl`` weight sync from two FSDP2 ranks (torchrun, gloo, CPU) into the embedded server, in-memory transport.

Rank 0 runs the embedded server in its process (its real HTTP routes) and pushes; rank 1 only takes part in the
lockstep gathers. Then a push the server refuses: both ranks must raise, with rank 0's reason. Each rank writes
``OUT.rank<N>.json``.
Usage: torchrun --nproc-per-node 2 tests/helpers/nccl_sync_ranks.py --model DIR --out PREFIX
"""

from __future__ import annotations

import argparse
import json

import torch

from asyncgrpo_cli.config.schema import EmbeddedServerConfig, NcclSyncConfig
from asyncgrpo_cli.sync.nccl import NcclSyncError, NcclWeightSync
from asyncgrpo_cli.train.distributed import destroy_distributed, init_distributed, shard_model
from tests.helpers.fake_nccl import LoopbackTransport


def start_server(model_dir: str, transport: LoopbackTransport):
    from asyncgrpo_cli.embedded.app import bind, build_app
    from asyncgrpo_cli.embedded.weight_transfer import WeightReceiver

    app = build_app(model_dir, EmbeddedServerConfig(max_model_len=256, max_num_seqs=4, kv_cache_tokens=1024))
    app.weight_transfer = WeightReceiver(app.engine, transport=transport, timeout=60)
    server = bind("127.0.0.1", 0)
    server.app = app
    server.start()
    return app, f"http://127.0.0.1:{server.port}"


def main() -> None:
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.server.control import ServerControl

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    info = init_distributed(torch.device("cpu"), timeout_s=120)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # the same on every rank (same seed)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    model = shard_model(model, info, torch.device("cpu"), mixed_precision=None, cpu_offload=False)
    result: dict = {"rank": info.rank}
    control = app = None
    transport = LoopbackTransport() if info.is_main else None
    if info.is_main:
        app, url = start_server(args.model, transport)
        control = ServerControl(url, timeout=60)
    sync = NcclWeightSync(
        control, None, info, NcclSyncConfig(buffer_size_bytes=40_000, timeout=60), transport=transport
    )
    result["timings"] = sync.push(model, 1)
    if info.is_main:
        served = app.engine.model.state_dict()
        result["max_diff"] = max(float((served[k] - v).abs().max()) for k, v in expected.items())
        result["weight_version"] = control.weight_version()
        app.weight_transfer.shutdown()  # the server drops the group: the next update_weights is refused
    try:
        sync.push(model, 2)
        result["second"] = "no error"
    except NcclSyncError as e:
        result["second"] = str(e)
    sync.close()
    with open(f"{args.out}.rank{info.rank}.json", "w") as f:
        json.dump(result, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
