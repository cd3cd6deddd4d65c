"""``GenerationEngine``: continuous batching over a transformers causal LM, on its own thread.

One engine step (under the engine lock):

1. admit waiting sequences while ``max_num_seqs`` and ``kv_cache_tokens`` allow (each sequence reserves
   prompt + max_tokens, so nothing is ever preempted); each distinct prompt (the G requests of a GRPO group, or
   the ``n`` choices of a request, share one) is an exact prefix-cache hit, or the tail after its longest cached
   prefix is prefilled (``prefill_tails``), or the whole prompt is; the result is cached;
2. run one decode forward over the running rows (the token each row sampled last step);
3. sample one token for every row (running and new) with vLLM's processed-logits pipeline;
4. cache the KV of rows that stopped (prompt + reply but its last token: a conversation's next turn starts with
   it), then retire finished rows and add the new ones in a single ``BatchKV.rebuild``.

KV enters the prefix cache only if no ``clear()`` (a weight update, ``reset_prefix_cache``) happened since its
sequence was admitted (``PrefixCache.epoch``). Prompt-logprob requests are prefilled whole (``scored_prefill``).

Hybrid models (gated-DeltaNet linear-attention layers beside attention layers, e.g. Qwen3.5) run in the same
batching engine with a state per sequence: each row carries its linear layers' conv window and recurrent state
beside the attention KV (``kvcache.py``), decode steps batch every running row (one token each, no padding:
exact), and a prefill batch holds only prompts (or tails after a cached prefix) of one length, because padding
is not exact for the recurrent layers; distinct prompts of other lengths go in batches of their own. The prefix
cache works for them as it does for dense models: an entry holds the state after exactly its tokens and is
reused whole. This was chosen over one request per forward: it is as exact (rows never interact) and keeps
batched decoding, at the price of a few lines of state surgery in ``BatchKV``.

``pause(mode)`` follows vLLM: ``keep`` freezes in-flight rows until ``resume()``, ``wait`` drains what was submitted
before the call, ``abort`` finishes everything in flight with ``finish_reason="abort"`` and its partial output.
Requests submitted while paused wait for ``resume()``; they are never rejected.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncgrpo_cli.embedded.kvcache import (
    BatchKV,
    PrefixCache,
    PrefixHit,
    RowKV,
    forward,
    linear_layers,
    prefill,
    prefill_tails,
)
from asyncgrpo_cli.embedded.lora import LoadedAdapter, lora_batch
from asyncgrpo_cli.embedded.model import load_weights_dir
from asyncgrpo_cli.embedded.prompt_logprobs import scored_prefill
from asyncgrpo_cli.embedded.requests import Completion, GenerationRequest, RequestHandle
from asyncgrpo_cli.embedded.sampling import BatchParams, SampleOutput, sample

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(eq=False)
class _Seq:
    handle: RequestHandle
    index: int
    prompt: tuple[int, ...]
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    order: int
    seen: torch.Tensor | None = None
    epoch: int = -1
    """``PrefixCache.epoch`` when the prompt's KV was made (its KV may be cached while the epoch holds)."""

    @property
    def request(self) -> GenerationRequest:
        return self.handle.request

    @property
    def out(self) -> Completion:
        return self.handle.completions[self.index]

    @property
    def reserved(self) -> int:
        return len(self.prompt) + self.request.max_tokens

    @property
    def needs_scores(self) -> bool:
        return self.request.prompt_logprobs is not None and self.out.prompt_scores is None

    @property
    def key(self) -> tuple[LoadedAdapter | None, tuple[int, ...]]:
        """What a prompt's KV depends on: the prompt and the adapter (prefill sharing, the prefix cache)."""
        return self.request.adapter, self.prompt


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_usage: float
    preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    request_success_total: dict[str, int]
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    prefill_tokens_total: int
    """Prompt tokens actually run through the model (prefix-cache hits and same-step duplicates cost none)."""
    prefix_cache_reused_tokens_total: int = 0
    """Prompt tokens whose KV came from the prefix cache (exact hits and cached prefixes)."""


class GenerationEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        max_num_seqs: int = 32,
        kv_cache_tokens: int = 65536,
        prefix_cache_size: int = 64,
        max_prefill_tokens: int = 8192,
        seed: int | None = None,
    ):
        if kv_cache_tokens < max_model_len:
            raise ValueError(
                f"kv_cache_tokens ({kv_cache_tokens}) must hold one max_model_len ({max_model_len})"
            )
        self.model = model
        self._hybrid = bool(linear_layers(model))
        """Prefill batches hold inputs of one length (no padding through the linear-attention layers)."""
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.kv_cache_tokens = kv_cache_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_cache = PrefixCache(prefix_cache_size)
        self._shared_gen = torch.Generator()
        self._shared_gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(7), "little"))
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._ctl_lock = threading.Lock()
        self._ctl_waiting = 0  # control calls waiting for the engine lock; the engine thread yields to them
        self._wakeup = threading.Event()
        self._inbox: deque[_Seq] = deque()
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._admitted: list[_Seq] = []  # popped from waiting by the step in progress
        self._kv = BatchKV()
        self._order = itertools.count()
        self._reserved = 0
        self._paused = False
        self._drain_before: int | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._zero_seen: torch.Tensor | None = None
        self.preemptions_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefill_tokens_total = 0
        self.success_total = dict.fromkeys(FINISH_REASONS, 0)

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> GenerationEngine:
        self._thread = threading.Thread(target=self._run, name="generation-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
        locked = self._lock.acquire(timeout=timeout)  # a step in progress ends within a step's time
        try:
            for seq in itertools.chain(self._inbox, self._waiting, self._running, self._admitted):
                if not seq.handle.done:
                    seq.handle._fail("the server is shutting down")
        finally:
            if locked:
                self._lock.release()

    # -- requests ----------------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        if len(request.prompt_ids) + request.max_tokens > self.max_model_len:
            raise ValueError("prompt + max_tokens exceeds max_model_len")
        handle = RequestHandle(request)
        stops = frozenset(request.stop_token_ids) | (
            frozenset() if request.ignore_eos else self.eos_token_ids
        )
        prompt = tuple(request.prompt_ids)
        for i in range(request.n):
            gen = None
            if request.seed is not None:
                gen = torch.Generator()
                gen.manual_seed(request.seed + i)
            self._inbox.append(_Seq(handle, i, prompt, stops, gen, next(self._order)))
        self._wakeup.set()
        return handle

    # -- control -----------------------------------------------------------------------------------------------
    def pause(self, mode: str = "abort", clear_cache: bool = False, timeout: float = 3600.0) -> None:
        """Pause generation (vLLM semantics, see the module doc); ``wait`` blocks until drained or ``timeout``."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        with self._control():
            self._take_inbox()
            if mode == "abort":
                self._abort_all()
            elif mode == "wait" and not self._paused:
                self._drain_before = next(self._order)
                deadline = time.monotonic() + timeout
                while self._has_undrained():
                    if self._stopping or time.monotonic() > deadline:
                        self._drain_before = None
                        raise TimeoutError(f"pause(mode=wait) did not drain within {timeout:g}s")
                    self._wakeup.set()
                    self._changed.wait(timeout=0.5)
                self._drain_before = None
            self._paused = True
            if clear_cache:
                self.prefix_cache.clear()

    def resume(self) -> None:
        with self._control():
            self._paused = False
        self._wakeup.set()

    @property
    def is_paused(self) -> bool:
        return self._paused

    def reset_prefix_cache(self) -> bool:
        with self._control():
            self.prefix_cache.clear()
        return True

    def reload_weights(self, weights_path: str | Path) -> int:
        """Load every ``*.safetensors`` of ``weights_path`` into the model between steps; clear the prefix cache."""
        with self._control():
            count = load_weights_dir(self.model, weights_path)
            self.prefix_cache.clear()
        return count

    def apply_weights(self, update: Callable[[torch.nn.Module], None]) -> None:
        """Run ``update(model)`` between engine steps (a weight transfer writing into the model in place); clear
        the prefix cache, whose KV came from the old weights."""
        with self._control():
            update(self.model)
            self.prefix_cache.clear()

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting) + len(self._inbox),
            kv_usage=self._reserved / self.kv_cache_tokens,
            preemptions_total=self.preemptions_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            request_success_total=dict(self.success_total),
            prefix_cache_queries_total=self.prefix_cache.queries,
            prefix_cache_hits_total=self.prefix_cache.hits,
            prefill_tokens_total=self.prefill_tokens_total,
            prefix_cache_reused_tokens_total=self.prefix_cache.reused_tokens,
        )

    def step(self) -> None:
        """Run one engine step on the calling thread (tests drive an engine this way, without ``start()``)."""
        if self._thread is not None:
            raise RuntimeError("step() drives an engine that was not started")
        with self._lock, torch.inference_mode():
            self._take_inbox()
            if not self._paused and (self._waiting or self._running):
                self._step()

    # -- the engine thread -------------------------------------------------------------------------------------
    @contextmanager
    def _control(self) -> Iterator[None]:
        """Hold the engine lock for a control call. A lock is not fair: the engine thread would win it back right
        after each step, so it yields (``_yield_to_control``) while a control call is waiting."""
        with self._ctl_lock:
            self._ctl_waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._ctl_lock:
                self._ctl_waiting -= 1
        try:
            yield
        finally:
            self._lock.release()

    def _yield_to_control(self, limit: float = 1.0) -> None:
        deadline = time.monotonic() + limit
        while self._ctl_waiting and time.monotonic() < deadline:
            time.sleep(0.0005)

    def _run(self) -> None:
        while not self._stopping:
            if not self._has_work():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            self._yield_to_control()
            with self._lock:
                self._take_inbox()
                if not self._paused and (self._waiting or self._running):
                    try:
                        with torch.inference_mode():
                            self._step()
                    except Exception as e:  # keep serving: fail what was in flight, report it
                        log.exception("engine step failed")
                        self._fail_all(f"generation failed: {type(e).__name__}: {e}")
                self._changed.notify_all()

    def _has_work(self) -> bool:
        return bool(self._inbox) or (not self._paused and bool(self._waiting or self._running))

    def _has_undrained(self) -> bool:
        cutoff = self._drain_before
        return bool(self._running) or any(s.order < cutoff for s in self._waiting)  # type: ignore[operator]

    def _take_inbox(self) -> None:
        while self._inbox:
            self._waiting.append(self._inbox.popleft())

    def _step(self) -> None:
        new = self._admitted = self._admit()
        new_kv, new_logits = self._prompt_logits(new)
        logits = self._decode_forward()
        if new_logits is not None:
            logits = new_logits if logits is None else torch.cat([logits, new_logits])
        rows = self._running + new
        finished = self._record(rows, self._sample(rows, logits))
        n_run = len(self._running)
        self._cache_replies([i for i in finished if i < n_run], logits)
        keep = [i for i in range(n_run) if i not in finished]
        fresh = [j for j in range(len(new)) if n_run + j not in finished]
        if finished or new:
            self._kv.rebuild(keep, [new_kv[j] for j in fresh])
        self._running = [rows[i] for i in keep] + [new[j] for j in fresh]
        self._admitted = []
        for i in sorted(finished):
            self._release(rows[i])

    def _admit(self) -> list[_Seq]:
        new: list[_Seq] = []
        prefill_budget = self.max_prefill_tokens
        planned: set[tuple[int, ...]] = set()
        scored: set[RequestHandle] = set()
        while self._waiting and len(self._running) + len(new) < self.max_num_seqs:
            seq = self._waiting[0]
            if self._drain_before is not None and seq.order >= self._drain_before:
                break
            if self._reserved + seq.reserved > self.kv_cache_tokens:
                break
            if seq.needs_scores:
                cost = 0 if seq.handle in scored else len(seq.prompt)
                scored.add(seq.handle)
            elif seq.key in planned:
                cost = 0
            else:
                cost = len(seq.prompt) - self.prefix_cache.cached_length(seq.prompt, seq.request.adapter)
            if cost and new and cost > prefill_budget:
                break
            prefill_budget -= cost
            planned.add(seq.key)
            self._waiting.popleft()
            self._reserved += seq.reserved
            self.prompt_tokens_total += len(seq.prompt)
            new.append(seq)
        return new

    def _prompt_logits(self, new: Sequence[_Seq]) -> tuple[list[RowKV], torch.Tensor | None]:
        """Prompt KV and first logits of the new sequences; each distinct prompt is prefilled once, from its
        longest cached prefix when there is one."""
        if not new:
            return [], None
        found: dict[tuple, tuple[RowKV, torch.Tensor]] = {}
        todo: dict[tuple, PrefixHit | None] = {}  # distinct (adapter, prompt) keys to prefill, in order
        for seq in new:  # prompt_logprobs requests: a scored prefill of their own, which the cache then holds
            seq.epoch = self.prefix_cache.epoch
            if seq.needs_scores:
                with lora_batch(self.model, [seq.request.adapter]):
                    row, lg, scores = scored_prefill(self.model, seq.prompt, seq.request.prompt_logprobs or 0)
                self.prefill_tokens_total += len(seq.prompt)
                for c in seq.handle.completions:
                    c.prompt_scores = scores
                found[seq.key] = (row, lg)
                self.prefix_cache.put(seq.prompt, row, lg, adapter=seq.request.adapter)
        for seq in new:
            if seq.key in found or seq.key in todo:
                continue
            hit = self.prefix_cache.longest_prefix(seq.prompt, seq.request.adapter)
            if hit is not None and hit.length == len(seq.prompt):
                found[seq.key] = (hit.row, hit.logits)
            else:
                todo[seq.key] = hit
        whole = sorted((k for k, hit in todo.items() if hit is None), key=lambda k: len(k[1]))
        same = (lambda k: len(k[1])) if self._hybrid else None
        for chunk in _chunks(whole, self.max_prefill_tokens, lambda k: len(k[1]), same):
            with lora_batch(self.model, [adapter for adapter, _ in chunk]):
                rows, logits = prefill(self.model, [prompt for _, prompt in chunk])
            self._store(chunk, rows, logits, found, sum(len(p) for _, p in chunk))
        tails = {k: hit for k, hit in todo.items() if hit is not None}
        ordered = sorted(tails, key=lambda k: len(k[1]) - tails[k].length)
        tail_len = (lambda k: len(k[1]) - tails[k].length) if self._hybrid else None
        for chunk in _chunks(ordered, self.max_prefill_tokens, lambda k: len(k[1]), tail_len):
            with lora_batch(self.model, [adapter for adapter, _ in chunk]):
                rows, logits = prefill_tails(
                    self.model, [tails[k].row for k in chunk], [k[1][tails[k].length :] for k in chunk]
                )
            self._store(chunk, rows, logits, found, sum(len(k[1]) - tails[k].length for k in chunk))
        return [found[s.key][0] for s in new], torch.stack([found[s.key][1] for s in new])

    def _store(
        self, keys: Sequence[tuple], rows: Sequence[RowKV], logits: torch.Tensor, found: dict, tokens: int
    ) -> None:
        """Record a prefill batch of ``tokens`` model tokens: into ``found`` and the prefix cache."""
        self.prefill_tokens_total += tokens
        for (adapter, prompt), row, lg in zip(keys, rows, logits):
            found[(adapter, prompt)] = (row, lg)
            self.prefix_cache.put(prompt, row, lg, adapter=adapter)

    def _cache_replies(self, finished: Sequence[int], logits: torch.Tensor) -> None:
        """Cache the KV of running rows ``finished`` that stopped (a length-cut reply ends a conversation): their
        prompt + reply but its last sampled token (never run through the model), and the logits it was sampled
        from, which are that sequence's last-position logits."""
        cache = self.prefix_cache
        for i in finished:
            seq = self._running[i]
            if cache.capacity <= 0 or seq.out.finish_reason != "stop" or seq.epoch != cache.epoch:
                continue
            tokens = seq.prompt + tuple(seq.out.token_ids[:-1])
            row = self._kv.row(i)
            assert row.length == len(tokens), (row.length, len(tokens))
            cache.put(tokens, row, logits[i].clone(), adapter=seq.request.adapter)

    def _decode_forward(self) -> torch.Tensor | None:
        if not self._running:
            return None
        tokens = torch.tensor([s.out.token_ids[-1] for s in self._running], dtype=torch.int64)[:, None]
        mask, positions = self._kv.decode_inputs()
        with lora_batch(self.model, [s.request.adapter for s in self._running]):
            logits = forward(
                self.model, self._kv.cache, input_ids=tokens, attention_mask=mask, position_ids=positions
            )
        self._kv.advance()
        return logits

    def _sample(self, rows: Sequence[_Seq], logits: torch.Tensor) -> SampleOutput:
        vocab = logits.shape[-1]
        params = BatchParams.build([s.request.params for s in rows], vocab)
        seen = self._seen_mask(rows, vocab) if params.use_penalty else None
        num_top = max(s.request.num_logprobs for s in rows)
        return sample(
            logits,
            params,
            [s.generator for s in rows],
            shared_generator=self._shared_gen,
            seen=seen,
            num_top=num_top,
            want_masks=[s.request.return_sampling_mask for s in rows],
        )

    def _seen_mask(self, rows: Sequence[_Seq], vocab: int) -> torch.Tensor:
        if self._zero_seen is None or self._zero_seen.shape[0] != vocab:
            self._zero_seen = torch.zeros(vocab, dtype=torch.bool)
        masks = []
        for s in rows:
            if s.request.params.repetition_penalty == 1.0:
                masks.append(self._zero_seen)
                continue
            if s.seen is None:
                s.seen = torch.zeros(vocab, dtype=torch.bool)
                s.seen[list(s.prompt) + s.out.token_ids] = True
            masks.append(s.seen)
        return torch.stack(masks)

    def _record(self, rows: Sequence[_Seq], out: SampleOutput) -> set[int]:
        """Append each row's token; return the indices of rows that finished."""
        ids, lps = out.token_ids.tolist(), out.logprobs.tolist()
        top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
        ranks = out.ranks.tolist() if out.ranks is not None else [None] * len(rows)
        finished = set()
        for i, seq in enumerate(rows):
            tok, comp = ids[i], seq.out
            comp.token_ids.append(tok)
            comp.logprobs.append(lps[i])
            comp.ranks.append(ranks[i])
            if seq.request.return_sampling_mask:
                if comp.sampling_mask is None:
                    comp.sampling_mask = []
                comp.sampling_mask.append(out.sampling_masks[i] if out.sampling_masks else None)
            n = seq.request.num_logprobs
            if n:
                comp.top.append(list(zip(top_ids[i][:n], top_lps[i][:n])))
            if seq.seen is not None:
                seq.seen[tok] = True
            if tok in seq.stop_ids:
                comp.finish_reason = "stop"
                if tok not in self.eos_token_ids or seq.request.ignore_eos:
                    comp.stop_reason = tok
            elif len(comp.token_ids) >= seq.request.max_tokens:
                comp.finish_reason = "length"
            if comp.finish_reason is not None:
                finished.add(i)
        self.generation_tokens_total += len(rows)
        return finished

    def _release(self, seq: _Seq) -> None:
        self._reserved -= seq.reserved
        self.success_total[seq.out.finish_reason or "abort"] += 1
        seq.handle._finish_choice()

    def _abort_all(self) -> None:
        for seq in itertools.chain(self._running, self._waiting):
            seq.out.finish_reason = "abort"
            self.success_total["abort"] += 1
            seq.handle._finish_choice()
        self._running, self._waiting = [], deque()
        self._kv = BatchKV()
        self._reserved = 0

    def _fail_all(self, message: str) -> None:
        for seq in itertools.chain(self._running, self._admitted, self._waiting):
            seq.handle._fail(message)
        self._running, self._admitted, self._waiting = [], [], deque()
        self._kv = BatchKV()
        self._reserved = 0


def _chunks(
    keys: Sequence[tuple],
    budget: int,
    size: Callable[[tuple], int],
    same: Callable[[tuple], int] | None = None,
) -> list[list[tuple]]:
    """Split keys (sorted so that similar sizes sit together) into prefill batches whose padded size (count x
    the largest ``size``) stays within ``budget`` tokens; with ``same``, a batch holds keys of one ``same`` value
    only (the input lengths of a hybrid model's batch: sorted, so equal ones are adjacent)."""
    chunks: list[list[tuple]] = []
    for key in keys:
        if (
            chunks
            and (same is None or same(key) == same(chunks[-1][0]))
            and (len(chunks[-1]) + 1) * max(size(key), *map(size, chunks[-1])) <= budget
        ):
            chunks[-1].append(key)
        else:
            chunks.append([key])
    return chunks
