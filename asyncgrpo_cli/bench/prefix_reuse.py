"""``asyncgrpo bench prefix-reuse``: the embedded server's turn-2 prefill with and without prefix reuse.

A multi-turn rollout's next prompt is its previous prompt + the sampled reply + a tool result. Without reuse the
server prefills all of it; with reuse (``embedded/kvcache.py``: ``PrefixCache.longest_prefix`` + ``prefill_tails``)
only the tokens after the longest cached prefix run. Side by side in one run, per batch size B: B prompts of
``--prompt`` random tokens whose first ``--cached`` tokens are cached, full prefill (``prefill``) vs tail prefill
(``prefill_tails`` from the cached KV); median wall time of ``--repeats`` runs after a warm-up, and the largest
difference of the last-position logits (the two must agree).

Usage: asyncgrpo bench prefix-reuse [--shape smollm2|tiny] [--prompt 500] [--cached 450] [--batch 1,8]
       [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

from asyncgrpo_cli.bench.shapes import serving_model


def _median_s(fn, args: tuple, repeats: int) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="asyncgrpo bench prefix-reuse")
    parser.add_argument("--shape", default="smollm2", choices=["smollm2", "tiny"])
    parser.add_argument("--prompt", type=int, default=500, help="tokens of each turn-2 prompt")
    parser.add_argument("--cached", type=int, default=450, help="of which cached (the turn-1 prompt + reply)")
    parser.add_argument("--batch", default="1,8", help="prompts prefilled together, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if not 0 < args.cached < args.prompt:
        raise SystemExit("--cached must be between 0 and --prompt (exclusive)")
    import torch

    from asyncgrpo_cli.embedded.kvcache import prefill, prefill_tails

    torch.set_num_threads(args.threads)
    model = serving_model(args.shape)
    vocab = model.config.vocab_size
    print(
        f"prefix reuse, {args.shape} shape, {args.threads} thread(s): {args.prompt}-token prompts, first "
        f"{args.cached} cached; median of {args.repeats}"
    )
    print(f"{'B':>3} {'full prefill s':>15} {'tail prefill s':>15} {'speedup':>8} {'max |dlogit|':>13}")
    with torch.inference_mode():
        for b in (int(x) for x in args.batch.split(",")):
            g = torch.Generator().manual_seed(b)
            prompts = [torch.randint(0, vocab, (args.prompt,), generator=g).tolist() for _ in range(b)]
            pasts, _ = prefill(model, [p[: args.cached] for p in prompts])
            tails = [p[args.cached :] for p in prompts]
            full_s = _median_s(prefill, (model, prompts), args.repeats)
            tail_s = _median_s(prefill_tails, (model, pasts, tails), args.repeats)
            _, full_logits = prefill(model, prompts)
            _, tail_logits = prefill_tails(model, pasts, tails)
            diff = float((full_logits - tail_logits).abs().max())
            print(f"{b:>3} {full_s:>15.3f} {tail_s:>15.3f} {full_s / tail_s:>7.1f}x {diff:>13.2e}")
