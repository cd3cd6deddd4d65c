"""The KV cache of the running batch, every piece of surgery on it, and the prefix cache.

Rows are right-aligned (left-padded) in preallocated per-layer buffers ``[B, H, capacity, D]``: a decode step
writes one column in place (``SlabLayer.update``) instead of re-concatenating the whole cache, as
``DynamicLayer`` does. Rows join and leave between decode steps through one operation, ``BatchKV.rebuild``, which
copies the surviving rows and the new rows into fresh buffers as wide as the longest row (so columns that only
held padding disappear). A new row arrives as a ``RowKV``: the unpadded KV of its prompt, from ``prefill``, from
the prefix cache, or from ``prefill_tails`` (a cached prefix's KV continued with the rest of the prompt).

Padding columns hold zeros and are masked out; the engine passes explicit 4D boolean masks and position ids, so
transformers' own mask construction is bypassed.

``PrefixCache`` keeps token sequences' KV (per LoRA adapter) for reuse: the KV of a sequence's first ``n`` tokens
depends on those tokens only (causal attention), so the entry of any cached sequence that starts a new prompt
serves its first ``n`` positions exactly, and only the tail is run (``prefill_tails``). vLLM reuses blocks of
any common prefix; here an entry is reused whole or not at all (``longest_prefix``).

Hybrid models (Qwen3.5 / Qwen3-Next style: gated-DeltaNet "linear_attention" layers beside full-attention
layers, ``linear_layers``) keep, per sequence and per linear layer, a state instead of KV: the causal conv's
window ``[C, K]`` and the recurrent matrix ``[H, Dk, Dv]``, both after the sequence's last token. A ``RowKV``
holds that pair in place of ``(keys, values)`` for those layers (``RowKV.linear``), ``BatchKV`` stacks the rows'
states along the batch in transformers' own ``LinearAttentionLayer`` (filled through its update methods, read
through its ``conv_states`` / ``recurrent_states``), and the model's forward advances them. What stays exact:

- decode: one new token per row and no padding, and each row's conv and recurrence see only that row, so a
  batch of rows advances exactly as each row alone would (the attention layers keep their left-padded KV);
- prefill and ``prefill_tails``: only inputs of one length per batch (``prefill`` raises otherwise). Left padding
  is exact for attention (masked) but not for the recurrent layers: with the engine's 4D masks transformers hands
  those layers no padding mask (``create_recurrent_attention_mask``), so padding tokens run through the conv and
  the recurrence; with a 2D mask they are zeroed (``apply_mask_to_padding_states``), which keeps a zero state at
  zero, but a padded tail after a cached state would still decay that state once per padding token;
- the prefix cache: an entry's state is the state after exactly its tokens, and an entry is reused whole, so a
  prompt that extends it continues from that state as if it had run the entry itself. Reusing part of an entry
  (vLLM's block reuse) would need the state at that token, which is not kept.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

try:  # the linear-attention (gated DeltaNet) cache layer of transformers' hybrid models; older 5.x lack it
    from transformers.cache_utils import LinearAttentionLayer
except ImportError:  # pragma: no cover - depends on the installed transformers
    LinearAttentionLayer = None

HEADROOM = 64
"""Free columns allocated past the longest row, so decode steps rarely have to grow the buffers."""


@lru_cache(maxsize=8)
def _cache_kwarg(model_cls: type) -> str:
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def linear_layers(model: torch.nn.Module) -> frozenset[int]:
    """Indices of the model's linear-attention layers (empty for a full-attention model)."""
    text = model.config.get_text_config(decoder=True)
    return frozenset(
        i for i, t in enumerate(getattr(text, "layer_types", None) or []) if t == "linear_attention"
    )


def forward(model: torch.nn.Module, cache: Cache, **inputs: torch.Tensor | int | bool) -> torch.Tensor:
    """``model(**inputs)`` with ``cache`` (transformers >= 5.2x) or ``past_key_values`` (earlier 5.x); returns logits
    of the last position, float32 ``[B, V]``, on the CPU. Inputs are built on the CPU and moved to the model's
    device (a GPU-served model keeps its KV cache there; sampling runs on the CPU)."""
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    out = model(**inputs, **{_cache_kwarg(type(model)): cache}, use_cache=True)
    return out.logits[:, -1, :].float().cpu()


class SlabLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are views of preallocated buffers that grow in chunks."""

    def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor, width: int):
        super().__init__()
        self._kbuf, self._vbuf = kbuf, vbuf
        self.device, self.dtype = kbuf.device, kbuf.dtype
        self.is_initialized = True
        self._set_width(width)

    def _set_width(self, width: int) -> None:
        self.keys = self._kbuf[:, :, :width]
        self.values = self._vbuf[:, :, :width]

    def _grow(self, needed: int) -> None:
        capacity = max(needed, self._kbuf.shape[2] + max(HEADROOM, self._kbuf.shape[2] // 4))
        width = self.keys.shape[2]
        for name in ("_kbuf", "_vbuf"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[3]))
            new[:, :, :width] = old[:, :, :width]
            setattr(self, name, new)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width, q = self.keys.shape[2], key_states.shape[2]
        if width + q > self._kbuf.shape[2]:
            self._grow(width + q)
        self._kbuf[:, :, width : width + q] = key_states
        self._vbuf[:, :, width : width + q] = value_states
        self._set_width(width + q)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[2]


@dataclass
class RowKV:
    """One sequence's KV, unpadded: per layer ``(keys, values)`` of shape ``[H, L, D]``; for a linear-attention layer
    (an index in ``linear``) its state after the last token instead, ``(conv state [C, K], recurrent state [H, Dk,
    Dv])``."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    linear: frozenset[int] = frozenset()

    @property
    def length(self) -> int:
        """Tokens the row holds (the KV length of its attention layers)."""
        for i, (keys, _) in enumerate(self.layers):
            if i not in self.linear:
                return keys.shape[1]
        raise ValueError("a row of linear-attention layers only has no token count")


def _state_layer(conv: torch.Tensor, recurrent: torch.Tensor) -> Any:
    """A transformers ``LinearAttentionLayer`` holding a batch's states (``[B, C, K]``, ``[B, H, Dk, Dv]``) as if it
    had run them: a fresh layer takes a conv state as wide as its kernel as it is, and marks it as a previous
    state, so the next forward continues from both."""
    layer = LinearAttentionLayer()
    layer.update_conv_state(conv)
    layer.update_recurrent_state(recurrent)
    return layer


def _state(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv states, recurrent states) of a ``LinearAttentionLayer``, batch first."""
    return layer.conv_states[0], layer.recurrent_states[0]


def cache_row(cache: Cache, i: int, start: int, linear: frozenset[int]) -> RowKV:
    """A copy of row ``i`` of ``cache`` (a prefill's): its KV from column ``start`` on, its linear layers' states."""
    layers = []
    for li, lay in enumerate(cache.layers):
        if li in linear:
            conv, recurrent = _state(lay)
            layers.append((conv[i].clone(), recurrent[i].clone()))
        else:
            layers.append((lay.keys[i, :, start:].clone(), lay.values[i, :, start:].clone()))
    return RowKV(layers, linear)


class BatchKV:
    """Left-padded KV of the running rows; ``lengths[i]`` is how many trailing columns row ``i`` owns."""

    def __init__(self) -> None:
        self.cache: Cache | None = None
        self.lengths: list[int] = []
        self.width = 0
        self.linear: frozenset[int] = frozenset()
        """The linear-attention layers (their entries in ``cache`` are ``LinearAttentionLayer`` s)."""

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def _layers(self) -> list[Any]:
        return [] if self.cache is None else self.cache.layers

    def rebuild(self, keep: Sequence[int], new_rows: Sequence[RowKV]) -> None:
        """Keep rows ``keep`` (in that order), then append ``new_rows``, in fresh right-aligned buffers."""
        lengths = [self.lengths[i] for i in keep] + [r.length for r in new_rows]
        if not lengths:
            self.cache, self.lengths, self.width = None, [], 0
            return
        old_layers = self._layers()
        linear = new_rows[0].linear if new_rows else self.linear
        width = max(lengths)
        capacity = width + HEADROOM
        n_keep = len(keep)
        keep_idx = torch.tensor(list(keep), dtype=torch.int64)
        m = min(self.width, width)  # trailing columns of old rows that fit (they hold every kept token)
        layers = []
        for li in range(len(old_layers) if old_layers else len(new_rows[0].layers)):
            if li in linear:
                layers.append(self._stack_states(li, keep, new_rows))
                continue
            ref = old_layers[li].keys if old_layers else new_rows[0].layers[li][0]
            heads, dim = ref.shape[-3], ref.shape[-1]
            kbuf = ref.new_zeros((len(lengths), heads, capacity, dim))
            vbuf = ref.new_zeros((len(lengths), heads, capacity, dim))
            if n_keep:
                old = old_layers[li]
                keep_idx = keep_idx.to(old.keys.device)
                kbuf[:n_keep, :, width - m : width] = old.keys[keep_idx, :, self.width - m :]
                vbuf[:n_keep, :, width - m : width] = old.values[keep_idx, :, self.width - m :]
            for j, row in enumerate(new_rows):
                k, v = row.layers[li]
                kbuf[n_keep + j, :, width - row.length : width] = k
                vbuf[n_keep + j, :, width - row.length : width] = v
            layers.append(SlabLayer(kbuf, vbuf, width))
        self.cache = Cache(layers=layers)
        self.lengths = lengths
        self.width = width
        self.linear = linear

    def _stack_states(self, li: int, keep: Sequence[int], new_rows: Sequence[RowKV]) -> Any:
        """Layer ``li``'s states of the kept rows then the new rows, in a fresh ``LinearAttentionLayer``."""
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        if keep:
            conv, recurrent = _state(self._layers()[li])
            idx = torch.tensor(list(keep), dtype=torch.int64, device=conv.device)
            parts.append((conv.index_select(0, idx), recurrent.index_select(0, idx)))
        if new_rows:
            pairs = [r.layers[li] for r in new_rows]
            parts.append((torch.stack([c for c, _ in pairs]), torch.stack([r for _, r in pairs])))
        return _state_layer(torch.cat([c for c, _ in parts]), torch.cat([r for _, r in parts]))

    def row(self, i: int) -> RowKV:
        """A copy of row ``i``'s valid columns (and of its linear layers' states)."""
        return cache_row(self.cache, i, self.width - self.lengths[i], self.linear)  # type: ignore[arg-type]

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(4D bool attention mask ``[B, 1, 1, width + 1]``, position ids ``[B, 1]``) for one new token per row."""
        lengths = torch.tensor(self.lengths, dtype=torch.int64)
        cols = torch.arange(self.width + 1, dtype=torch.int64)
        mask = cols[None, :] >= (self.width - lengths)[:, None]
        return mask[:, None, None, :], lengths[:, None]

    def advance(self) -> None:
        """Account for the token each row just wrote (after a decode forward)."""
        self.lengths = [n + 1 for n in self.lengths]
        self.width += 1


def prefill_inputs(prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ``input_ids``, 4D bool causal mask and position ids for a batch of prompts.

    Padding queries attend to themselves only, so no attention row is empty (an empty row would give NaN keys and
    values that poison later steps through 0 * NaN).
    """
    width = max(len(p) for p in prompts)
    pads = torch.tensor([width - len(p) for p in prompts], dtype=torch.int64)
    ids = torch.zeros((len(prompts), width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.int64)
    cols = torch.arange(width, dtype=torch.int64)
    valid = cols[None, :] >= pads[:, None]  # [n, width]
    causal = cols[None, :, None] >= cols[None, None, :]  # [1, q, k]
    eye = torch.eye(width, dtype=torch.bool)[None]
    mask = (causal & valid[:, None, :]) | eye
    positions = (cols[None, :] - pads[:, None]).clamp_(min=0)
    return ids, mask[:, None], positions


def _check_unpadded(linear: frozenset[int], lengths: Sequence[int], what: str) -> None:
    if linear and len(set(lengths)) > 1:
        raise ValueError(
            f"{what} of a hybrid model takes inputs of one length per batch: padding would run through its "
            f"linear-attention layers (lengths {sorted(set(lengths))})"
        )


def prefill(model: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> tuple[list[RowKV], torch.Tensor]:
    """Run the prompts (one left-padded batch; of one length for a hybrid model); return each prompt's KV and its
    last-position logits ``[n, V]``."""
    linear = linear_layers(model)
    _check_unpadded(linear, [len(p) for p in prompts], "prefill")
    ids, mask, positions = prefill_inputs(prompts)
    cache = DynamicCache(config=model.config)
    logits = forward(
        model, cache, input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1
    )
    width = ids.shape[1]
    return [cache_row(cache, i, width - len(p), linear) for i, p in enumerate(prompts)], logits


def prefill_tails(
    model: torch.nn.Module, pasts: Sequence[RowKV], tails: Sequence[Sequence[int]]
) -> tuple[list[RowKV], torch.Tensor]:
    """Continue cached KV: run ``tails[i]`` (non-empty) after ``pasts[i]``, the KV of the first ``n_i`` tokens of a
    prompt, at positions ``n_i ..``; return each whole prompt's KV and its last-position logits ``[n, V]``.

    One batch: the pasts right-aligned in columns ``[0, P)``, the tails right-aligned in ``[P, P + M)`` (``P``,
    ``M``: the longest past and tail). A tail token attends its row's past and the tail tokens before it; padding
    queries attend themselves only (as in ``prefill_inputs``). Only the tails' tokens go through the model. A hybrid
    model's linear layers continue from each past's state; its tails must have one length (no padding).
    """
    if not tails or len(pasts) != len(tails) or any(len(t) == 0 for t in tails):
        raise ValueError("prefill_tails needs one past per tail, and non-empty tails")
    linear = linear_layers(model)
    _check_unpadded(linear, [len(t) for t in tails], "prefill_tails")
    past_len = torch.tensor([r.length for r in pasts], dtype=torch.int64)
    tail_len = torch.tensor([len(t) for t in tails], dtype=torch.int64)
    pw, tw = int(past_len.max()), int(tail_len.max())
    tail_pad = tw - tail_len
    ids = torch.zeros((len(tails), tw), dtype=torch.int64)
    for i, t in enumerate(tails):
        ids[i, tw - len(t) :] = torch.tensor(list(t), dtype=torch.int64)
    cols, q = torch.arange(pw + tw, dtype=torch.int64), torch.arange(tw, dtype=torch.int64)
    valid = ((cols[None] >= pw - past_len[:, None]) & (cols[None] < pw)) | (
        cols[None] >= pw + tail_pad[:, None]
    )
    causal = cols[None, None, :] <= pw + q[None, :, None]  # [1, q, k]
    real = q[None, :] >= tail_pad[:, None]  # [n, q]
    itself = cols[None, None, :] == pw + q[None, :, None]
    mask = (real[:, :, None] & causal & valid[:, None, :]) | itself
    positions = (past_len[:, None] + q[None, :] - tail_pad[:, None]).clamp_(min=0)
    kv = BatchKV()
    kv.rebuild([], pasts)  # the pasts right-aligned at width P; the forward appends the tails
    logits = forward(
        model, kv.cache, input_ids=ids, attention_mask=mask[:, None], position_ids=positions, logits_to_keep=1
    )
    rows = []
    for i, (n, m) in enumerate(zip(past_len.tolist(), tail_len.tolist())):
        spans = ((pw - n, pw), (pw + tw - m, pw + tw))  # the row's past, then its tail
        layers = []
        for li, lay in enumerate(kv._layers()):
            if li in linear:
                conv, recurrent = _state(lay)
                layers.append((conv[i].clone(), recurrent[i].clone()))
            else:
                layers.append((_take(lay.keys, i, spans), _take(lay.values, i, spans)))
        rows.append(RowKV(layers, linear))
    return rows, logits


def _take(t: torch.Tensor, row: int, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t[row, :, a:b] for a, b in spans], dim=1)


class PrefixHit(NamedTuple):
    """A cached sequence that starts the prompt looked up: its first ``length`` tokens' KV and the logits of its
    last position (the prompt's own last logits when ``length`` is the prompt's length: an exact hit)."""

    length: int
    row: RowKV
    logits: torch.Tensor


class PrefixCache:
    """LRU of (adapter, token sequence) -> (its KV, its last-position logits).

    Entries are prompts (so the requests of a group prefill their prompt once) and, from the engine, finished
    replies (prompt + generated tokens but the last, whose KV was never computed: it would be the next step's
    input), which start the next turn of a conversation. The capacity counts entries. ``clear()`` (weight
    reloads, ``reset_prefix_cache``) bumps ``epoch``, so KV computed before it is never put back afterwards.

    A plain dict in LRU order (oldest first): iterating an ``OrderedDict`` re-hashes every key, O(length) for a
    tuple of tokens, which would make the ``longest_prefix`` scan cost O(total cached tokens).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: dict[tuple[Any, tuple[int, ...]], tuple[RowKV, torch.Tensor]] = {}
        self.queries = 0
        self.hits = 0
        self.reused_tokens = 0
        """Prompt tokens whose KV came from the cache instead of a forward (exact and prefix hits)."""
        self.epoch = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, prompt: object) -> bool:
        """Whether ``prompt`` is cached for the base model (no adapter)."""
        return (None, prompt) in self._entries

    def get(self, prompt: tuple[int, ...], adapter: Any = None) -> tuple[RowKV, torch.Tensor] | None:
        """The exact entry of ``prompt``, or None."""
        self.queries += 1
        entry = self._entries.get((adapter, prompt))
        if entry is not None:
            self._hit((adapter, prompt))
        return entry

    def longest_prefix(self, prompt: tuple[int, ...], adapter: Any = None) -> PrefixHit | None:
        """The longest entry (of the same adapter) that is ``prompt`` itself or a strict prefix of it, or None.

        Cost: one dict lookup for an exact hit; otherwise a scan of the entries with O(1) rejections (adapter,
        length, the entry's last and middle tokens against the prompt's at those positions), and an O(n) tuple
        comparison of a candidate that passes them: ~0.1 ms for 256 entries of ~2k tokens sharing 1.8k.
        """
        self.queries += 1
        key = (adapter, prompt)
        best = key if key in self._entries else self._longest_strict_prefix(prompt, adapter)
        if best is None:
            return None
        self._hit(best)
        row, logits = self._entries[best]
        return PrefixHit(len(best[1]), row, logits)

    def cached_length(self, prompt: tuple[int, ...], adapter: Any = None) -> int:
        """How many leading tokens of ``prompt`` the cache holds (``longest_prefix`` without counting it)."""
        if (adapter, prompt) in self._entries:
            return len(prompt)
        best = self._longest_strict_prefix(prompt, adapter)
        return 0 if best is None else len(best[1])

    def _longest_strict_prefix(self, prompt: tuple[int, ...], adapter: Any) -> tuple | None:
        best, best_len, size = None, 0, len(prompt)
        for key in self._entries:
            owner, tokens = key
            n = len(tokens)
            if (
                best_len < n < size
                and owner is adapter
                and tokens[-1] == prompt[n - 1]
                and tokens[n // 2] == prompt[n // 2]
                and tokens == prompt[:n]
            ):
                best, best_len = key, n
        return best

    def _hit(self, key: tuple) -> None:
        self.hits += 1
        self.reused_tokens += len(key[1])
        self._entries[key] = self._entries.pop(key)  # most recently used: last

    def put(self, prompt: tuple[int, ...], row: RowKV, logits: torch.Tensor, adapter: Any = None) -> None:
        if self.capacity <= 0:
            return
        key = (adapter, prompt)
        self._entries.pop(key, None)
        self._entries[key] = (row, logits)
        while len(self._entries) > self.capacity:
            del self._entries[next(iter(self._entries))]

    def clear(self) -> None:
        self._entries.clear()
        self.epoch += 1
