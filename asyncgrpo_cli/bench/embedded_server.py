"""``asyncgrpo bench embedded-server``: generated tokens/s of the embedded server's engine against
``model.generate`` on a batch of the same size, side by side in one process, at several concurrencies.

The model has the shape of the configured one with random weights (no download), or ``--shape smollm2`` for
SmolLM2-135M's shape. Requests come in GRPO groups of 8 sharing a prompt; EOS is ignored so every request
produces exactly ``--new`` tokens.

With ``--http starlette,stdlib`` the server is measured through HTTP instead, one HTTP stack beside the other
(``embedded_http.py``: latency of small requests, tokens/s at each concurrency).

Usage: asyncgrpo bench embedded-server [--shape smollm2|tiny] [--threads 1] [--concurrency 1,8,16,32]
       [--prompt-len 100] [--new 160] [--num-logprobs 8] [--http starlette,stdlib [--requests 200] [--repeat 1]]
"""

from __future__ import annotations

import argparse
import time

from asyncgrpo_cli.bench.shapes import serving_model


def _engine_tok_s(model, prompts: list[list[int]], new: int, num_logprobs: int) -> float:
    from asyncgrpo_cli.embedded.engine import GenerationEngine
    from asyncgrpo_cli.embedded.requests import GenerationRequest
    from asyncgrpo_cli.embedded.sampling import SamplingParams

    max_len = max(len(p) for p in prompts) + new + 1
    engine = GenerationEngine(
        model,
        eos_token_ids=[],
        max_model_len=max_len,
        max_num_seqs=len(prompts),
        kv_cache_tokens=max_len * len(prompts),
        seed=0,
    )
    engine.start()
    try:
        t0 = time.perf_counter()
        handles = [
            engine.submit(
                GenerationRequest(
                    prompt_ids=p,
                    max_tokens=new,
                    seed=i,
                    num_logprobs=num_logprobs,
                    params=SamplingParams(temperature=1.0),
                    ignore_eos=True,
                )
            )
            for i, p in enumerate(prompts)
        ]
        for h in handles:
            if not h.wait(timeout=3600):
                raise TimeoutError("engine request did not finish within an hour")
        elapsed = time.perf_counter() - t0
    finally:
        engine.shutdown(timeout=30)
    return sum(len(h.completions[0].token_ids) for h in handles) / elapsed


def _generate_tok_s(model, prompts: list[list[int]], new: int) -> float:
    import torch

    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
        )
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - t0)


def main(argv: list[str]) -> None:
    import torch

    parser = argparse.ArgumentParser(prog="asyncgrpo bench embedded-server")
    parser.add_argument("--shape", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--concurrency", default="1,8,16,32")
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--new", type=int, default=160)
    parser.add_argument("--num-logprobs", type=int, default=8)
    parser.add_argument("--http", default="", help="HTTP stacks to compare, e.g. starlette,stdlib")
    parser.add_argument("--requests", type=int, default=200, help="--http: sequential requests per latency")
    parser.add_argument("--repeat", type=int, default=1, help="--http: rounds of the stacks, alternating")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = serving_model(args.shape)
    vocab = model.config.vocab_size
    if args.http:
        from asyncgrpo_cli.bench import embedded_http

        del model  # each stack's server process builds its own
        concurrency = [int(x) for x in args.concurrency.split(",")]
        embedded_http.run(args, args.http.split(","), concurrency, vocab)
        return
    gen = torch.Generator().manual_seed(0)
    print(
        f"shape {args.shape}, {args.threads} torch thread(s), prompt {args.prompt_len}, {args.new} new tokens, "
        f"top-{args.num_logprobs} log-probs, groups of 8 sharing a prompt"
    )
    print(f"{'concurrency':>11} {'engine tok/s':>13} {'generate tok/s':>15} {'ratio':>6}")
    for c in (int(x) for x in args.concurrency.split(",")):
        groups = [
            torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range((c + 7) // 8)
        ]
        prompts = [groups[i // 8] for i in range(c)]
        eng = _engine_tok_s(model, prompts, args.new, args.num_logprobs)
        ref = _generate_tok_s(model, prompts, args.new)
        print(f"{c:>11} {eng:>13.1f} {ref:>15.1f} {eng / ref:>6.2f}", flush=True)
