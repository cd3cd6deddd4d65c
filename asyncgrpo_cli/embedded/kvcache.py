"""The KV cache of the running batch, and every piece of surgery on it.

Rows are right-aligned (left-padded) in preallocated per-layer buffers ``[B, H, capacity, D]``: a decode step
writes one column in place (``SlabLayer.update``) instead of re-concatenating the whole cache, as
``DynamicLayer`` does. Rows join and leave between decode steps through one operation, ``BatchKV.rebuild``, which
copies the surviving rows and the new rows into fresh buffers as wide as the longest row (so columns that only
held padding disappear). A new row arrives as a ``RowKV``: the unpadded KV of its prompt, from ``prefill`` or from
the prefix cache.

Padding columns hold zeros and are masked out; the engine passes explicit 4D boolean masks and position ids, so
transformers' own mask construction is bypassed.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

HEADROOM = 64
"""Free columns allocated past the longest row, so decode steps rarely have to grow the buffers."""


@lru_cache(maxsize=8)
def _cache_kwarg(model_cls: type) -> str:
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


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
    """One sequence's KV, unpadded: per layer ``(keys, values)`` of shape ``[H, L, D]``."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[1]


class BatchKV:
    """Left-padded KV of the running rows; ``lengths[i]`` is how many trailing columns row ``i`` owns."""

    def __init__(self) -> None:
        self.cache: Cache | None = None
        self.lengths: list[int] = []
        self.width = 0

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def _layers(self) -> list[SlabLayer]:
        return [] if self.cache is None else self.cache.layers  # type: ignore[return-value]

    def rebuild(self, keep: Sequence[int], new_rows: Sequence[RowKV]) -> None:
        """Keep rows ``keep`` (in that order), then append ``new_rows``, in fresh right-aligned buffers."""
        lengths = [self.lengths[i] for i in keep] + [r.length for r in new_rows]
        if not lengths:
            self.cache, self.lengths, self.width = None, [], 0
            return
        old_layers = self._layers()
        width = max(lengths)
        capacity = width + HEADROOM
        n_keep = len(keep)
        keep_idx = torch.tensor(list(keep), dtype=torch.int64)
        m = min(self.width, width)  # trailing columns of old rows that fit (they hold every kept token)
        layers = []
        for li in range(len(old_layers) if old_layers else len(new_rows[0].layers)):
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

    def row(self, i: int) -> RowKV:
        """A copy of row ``i``'s valid columns."""
        start = self.width - self.lengths[i]
        return RowKV(
            [(lay.keys[i, :, start:].clone(), lay.values[i, :, start:].clone()) for lay in self._layers()]
        )

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


def prefill(model: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> tuple[list[RowKV], torch.Tensor]:
    """Run the prompts (one left-padded batch); return each prompt's KV and its last-position logits ``[n, V]``."""
    ids, mask, positions = prefill_inputs(prompts)
    cache = DynamicCache(config=model.config)
    logits = forward(
        model, cache, input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1
    )
    width = ids.shape[1]
    rows = []
    for i, p in enumerate(prompts):
        start = width - len(p)
        rows.append(
            RowKV(
                [(lay.keys[i, :, start:].clone(), lay.values[i, :, start:].clone()) for lay in cache.layers]
            )
        )
    return rows, logits


class PrefixCache:
    """LRU of exact prompts -> (prompt KV, last logits), so the requests of a group prefill their prompt once."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], tuple[RowKV, torch.Tensor]] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, prompt: object) -> bool:
        return prompt in self._entries

    def get(self, prompt: tuple[int, ...]) -> tuple[RowKV, torch.Tensor] | None:
        self.queries += 1
        entry = self._entries.get(prompt)
        if entry is not None:
            self.hits += 1
            self._entries.move_to_end(prompt)
        return entry

    def put(self, prompt: tuple[int, ...], row: RowKV, logits: torch.Tensor) -> None:
        if self.capacity <= 0:
            return
        self._entries[prompt] = (row, logits)
        self._entries.move_to_end(prompt)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
