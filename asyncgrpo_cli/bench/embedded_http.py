"""``asyncgrpo bench embedded-server --http starlette,stdlib``: the embedded server through HTTP, one HTTP stack
beside the other on the same route table, app and engine.

Each stack serves from a child process (spawned: the model, the engine thread and the HTTP layer), as the real
server does; this process is the client, an ``httpx.AsyncClient`` as the rollout's. Measured per stack:
round-trip latency of ``GET /health`` and of a one-token ``POST /inference/v1/generate`` (sequential, median
and p90), then generated tokens/s of ``/inference/v1/generate`` at each concurrency (GRPO groups of 8 sharing a
prompt, EOS ignored). ``starlette`` is the shipped stack (``embedded/http_server.py``), ``stdlib`` the former
``http.server`` one (``bench/stdlib_http.py``). All stacks' servers run at once and take turns, request by
request for latency and batch by batch for tokens/s (``--repeat`` rounds, median), so a shared machine's
drifting load falls on each alike.
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

    from asyncgrpo_cli.bench.shapes import serving_model
    from asyncgrpo_cli.config.schema import EmbeddedServerConfig
    from asyncgrpo_cli.embedded.api import ModelContext
    from asyncgrpo_cli.embedded.app import ROUTES, EmbeddedApp, bind
    from asyncgrpo_cli.embedded.engine import GenerationEngine

    torch.set_num_threads(threads)
    model = serving_model(shape)
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


async def _latency(clients: dict[str, Any], n: int, prompt: list[int]) -> dict[str, dict[str, list[float]]]:
    """Milliseconds per sequential request, the stacks taking turns request by request (same load for each)."""
    calls = {
        "health": lambda c: c.get("/health"),
        "generate1": lambda c: c.post("/inference/v1/generate", json=_body(prompt, 1, 0, 0)),
    }
    out: dict[str, dict[str, list[float]]] = {name: {s: [] for s in clients} for name in calls}
    for name, call in calls.items():
        for client in clients.values():
            (await call(client)).raise_for_status()  # warm-up (connection, first step)
        for i in range(n):
            for stack in list(clients)[:: 1 if i % 2 else -1]:
                t0 = time.perf_counter()
                resp = await call(clients[stack])
                out[name][stack].append((time.perf_counter() - t0) * 1000)
                resp.raise_for_status()
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


async def _measure(ports: dict[str, int], workloads: list[list[list[int]]], args: Any) -> tuple[dict, dict]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    clients = {
        stack: httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=3600, limits=limits)
        for stack, port in ports.items()
    }
    try:
        latency = await _latency(clients, args.requests, workloads[0][0][:8])
        rates: dict[str, list[list[float]]] = {s: [[] for _ in workloads] for s in clients}
        for client in clients.values():
            await _tok_s(client, workloads[0][:1], 4, args.num_logprobs)  # warm-up
        for rep in range(args.repeat):
            for k, prompts in enumerate(workloads):
                for stack in list(clients)[:: 1 if rep % 2 else -1]:
                    rates[stack][k].append(await _tok_s(clients[stack], prompts, args.new, args.num_logprobs))
    finally:
        for client in clients.values():
            await client.aclose()
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
    ctx = mp.get_context("spawn")
    procs, ports = [], {}
    try:
        for stack in stacks:  # every stack's server up at once, idle while another one is measured
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve, args=(stack, args.shape, args.threads, max_len, max_seqs, child)
            )
            proc.start()
            procs.append((proc, parent))
            if not parent.poll(600):
                raise TimeoutError(f"the {stack} server did not start within 600 s")
            ports[stack] = parent.recv()
        latency, rates = asyncio.run(_measure(ports, workloads, args))
    finally:
        for _, parent in procs:
            parent.send("stop")
        for proc, _ in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    print(
        f"through HTTP: shape {args.shape}, {args.threads} torch thread(s) per server, prompt {args.prompt_len}, "
        f"{args.new} new tokens, top-{args.num_logprobs} log-probs; the stacks take turns: latency over "
        f"{args.requests} sequential requests each, tokens/s the median of {args.repeat} round(s)"
    )
    cols = "".join(f"{f'c={c} tok/s':>13}" for c in concurrency)
    print(f"{'stack':>10} {'health p50/p90 ms':>18} {'generate1 p50/p90 ms':>21}{cols}")
    for stack in stacks:
        h, g = _quantiles(latency["health"][stack]), _quantiles(latency["generate1"][stack])
        row = "".join(f"{statistics.median(r):>13.1f}" for r in rates[stack])
        print(f"{stack:>10} {f'{h[0]:.2f} / {h[1]:.2f}':>18} {f'{g[0]:.2f} / {g[1]:.2f}':>21}{row}")
