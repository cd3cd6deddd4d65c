"""``asyncgrpo bench embedded-server --http starlette,stdlib``: the embedded server through HTTP, one HTTP stack
beside the other on the same route table, app and engine.

Each stack serves from a child process (spawned: the model, the engine thread and the HTTP layer), as the real
server does; this process is the client, an ``httpx.AsyncClient`` as the rollout's. Measured per stack:
round-trip latency of ``GET /health`` and of a one-token ``POST /inference/v1/generate`` (sequential, median
and p90), then generated tokens/s of ``/inference/v1/generate`` at each concurrency (GRPO groups of 8 sharing a
prompt, EOS ignored). ``starlette`` is the shipped stack (``embedded/http_server.py``), ``stdlib`` the former
``http.server`` one (``bench/stdlib_http.py``). With ``--repeat N`` the stacks alternate N times (the machine's
load drifts).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time
from typing import Any

STACKS = ("starlette", "stdlib")


def _serve(stack: str, shape: str, threads: int, max_len: int, max_seqs: int, conn: Any) -> None:
    """The child: a random model of ``shape`` behind the embedded app and the ``stack`` HTTP layer."""
    import torch

    from asyncgrpo_cli.bench.embedded_server import _model
    from asyncgrpo_cli.config.schema import EmbeddedServerConfig
    from asyncgrpo_cli.embedded.api import ModelContext
    from asyncgrpo_cli.embedded.app import ROUTES, EmbeddedApp, bind
    from asyncgrpo_cli.embedded.engine import GenerationEngine

    torch.set_num_threads(threads)
    model = _model(shape)
    engine = GenerationEngine(
        model,
        eos_token_ids=[],
        max_model_len=max_len,
        max_num_seqs=max_seqs,
        kv_cache_tokens=max_len * max_seqs,
    ).start()
    ctx = ModelContext(
        served_name=shape, tokenizer=None, vocab_size=model.config.vocab_size, max_model_len=max_len
    )
    cfg = EmbeddedServerConfig(
        max_model_len=max_len, max_num_seqs=max_seqs, kv_cache_tokens=max_len * max_seqs
    )
    app = EmbeddedApp(
        engine=engine, ctx=ctx, model_dir=f"random:{shape}", cfg=cfg, dtype_name=str(model.dtype)
    )
    if stack == "stdlib":
        from asyncgrpo_cli.bench.stdlib_http import StdlibHTTPServer

        server: Any = StdlibHTTPServer("127.0.0.1", 0, ROUTES)
    else:
        server = bind("127.0.0.1", 0)
    server.app = app
    server.start()
    conn.send(server.port)
    conn.poll(7200)  # until the parent says stop (or two hours)
    app.stopping.set()
    server.stop()
    engine.shutdown(timeout=30)


def _body(prompt: list[int], new: int, seed: int, num_logprobs: int) -> dict:
    params = {
        "max_tokens": new,
        "temperature": 1.0,
        "seed": seed,
        "ignore_eos": True,
        "logprobs": num_logprobs,
    }
    return {"token_ids": prompt, "sampling_params": params, "output_mode": "tokens", "stream": False}


def _quantiles(ms: list[float]) -> tuple[float, float]:
    return statistics.median(ms), statistics.quantiles(ms, n=10)[-1]


async def _latency(client: Any, n: int, prompt: list[int]) -> dict[str, tuple[float, float]]:
    out = {}
    for name, call in (
        ("health", lambda: client.get("/health")),
        ("generate1", lambda: client.post("/inference/v1/generate", json=_body(prompt, 1, 0, 0))),
    ):
        await call()  # warm-up (connection, first step)
        ms = []
        for _ in range(n):
            t0 = time.perf_counter()
            resp = await call()
            ms.append((time.perf_counter() - t0) * 1000)
            resp.raise_for_status()
        out[name] = _quantiles(ms)
    return out


async def _tok_s(client: Any, prompts: list[list[int]], new: int, num_logprobs: int) -> float:
    t0 = time.perf_counter()
    resps = await asyncio.gather(
        *(
            client.post("/inference/v1/generate", json=_body(p, new, i, num_logprobs))
            for i, p in enumerate(prompts)
        )
    )
    elapsed = time.perf_counter() - t0
    tokens = 0
    for r in resps:
        r.raise_for_status()
        tokens += sum(len(c["token_ids"]) for c in r.json()["choices"])
    return tokens / elapsed


async def _client(port: int, workloads: list[list[list[int]]], args: Any) -> tuple[dict, list[float]]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=3600, limits=limits) as client:
        latency = await _latency(client, args.requests, workloads[0][0][:8])
        await _tok_s(client, workloads[0][:1], 4, args.num_logprobs)  # warm-up
        rates = [await _tok_s(client, prompts, args.new, args.num_logprobs) for prompts in workloads]
    return latency, rates


def run(args: Any, stacks: list[str], concurrency: list[int], vocab: int) -> None:
    import torch

    unknown = set(stacks) - set(STACKS)
    if unknown:
        raise SystemExit(f"--http: unknown stack(s) {sorted(unknown)}; choose from {', '.join(STACKS)}")
    gen = torch.Generator().manual_seed(0)
    workloads = []
    for c in concurrency:
        groups = [
            torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range((c + 7) // 8)
        ]
        workloads.append([groups[i // 8] for i in range(c)])
    max_len, max_seqs = args.prompt_len + args.new + 1, max(concurrency)
    print(
        f"through HTTP: shape {args.shape}, {args.threads} torch thread(s) in the server, prompt {args.prompt_len}, "
        f"{args.new} new tokens, top-{args.num_logprobs} log-probs; latency over {args.requests} sequential requests"
    )
    cols = "".join(f"{f'c={c} tok/s':>13}" for c in concurrency)
    print(f"{'stack':>10} {'health p50/p90 ms':>18} {'generate1 p50/p90 ms':>21}{cols}")
    ctx = mp.get_context("spawn")
    for _ in range(args.repeat):
        for stack in stacks:
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve, args=(stack, args.shape, args.threads, max_len, max_seqs, child)
            )
            proc.start()
            try:
                if not parent.poll(600):
                    raise TimeoutError(f"the {stack} server did not start within 600 s")
                latency, rates = asyncio.run(_client(parent.recv(), workloads, args))
            finally:
                parent.send("stop")
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
            h, g = latency["health"], latency["generate1"]
            row = "".join(f"{r:>13.1f}" for r in rates)
            print(
                f"{stack:>10} {f'{h[0]:.2f} / {h[1]:.2f}':>18} {f'{g[0]:.2f} / {g[1]:.2f}':>21}{row}",
                flush=True,
            )
