"""Per-window metric reduction (reference section g.1). Plain Python: no torch, no numpy required.

Everything recorded since the previous log lives in one ``MetricWindow``. Three kinds of records:

- **items** (``add`` / ``extend``): one value per rollout, sample, call or step. Reduced by name: if the last
  path segment contains the word ``count`` or ``total`` the values are summed, ``max`` keeps the largest, ``min`` the smallest,
  anything else is the mean over all items of the window (not a mean of per-step means).
- **rates** (``add_rate``): numerator/denominator pairs reduced to sum(num) / sum(den), never a mean of ratios.
  They also serve as weighted means, e.g. a per-token mean reported per micro-batch as (sum, token count).
- **gauges** (``set_gauge``): the most recent value wins (queue sizes, the cumulative ``num_tokens``).

The rollout process records into its own window and ships ``take_payload()`` (plain, picklable data) over a
queue; the trainer ``merge``s it before reducing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

Aggregation = Literal["sum", "max", "min", "mean"]
Payload = dict[str, dict[str, Any]]
"""``{"items": {name: [v, ...]}, "rates": {name: [sum_num, sum_den, n_pairs]}, "gauges": {name: [v, unix_time]}}``."""

_KINDS = ("items", "rates", "gauges")


def aggregation(name: str) -> Aggregation:
    """How an item metric is reduced over a window, from the words of the last path segment of its name.

    Words are the '_'-separated parts (case-insensitive): ``sample/dropped_stale_count`` and
    ``distill/teacher_tokens_total`` sum, ``completions/max_length`` and ``sampling/importance_sampling_ratio/max`` keep the maximum,
    ``clip_ratio/low_min`` the minimum; ``maximum``, ``country`` or ``totally`` are not the words ``max`` /
    ``count`` / ``total``.
    """
    words = name.rsplit("/", 1)[-1].lower().split("_")
    if "count" in words or "total" in words:
        return "sum"
    if "max" in words:
        return "max"
    if "min" in words:
        return "min"
    return "mean"


def reduce_metric(name: str, values: Sequence[float]) -> float:
    """Reduce the item values of one metric over a window (NaNs ignored unless every value is NaN)."""
    if not values:
        raise ValueError(f"metric {name!r} has no values to reduce")
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return math.nan
    how = aggregation(name)
    if how == "sum":
        return math.fsum(finite)
    if how == "max":
        return max(finite)
    if how == "min":
        return min(finite)
    return math.fsum(finite) / len(finite)


def reduce_rate(num: float, den: float) -> float:
    """sum(numerators) / sum(denominators); NaN when the denominator is zero (e.g. no tool call in the window)."""
    return num / den if den != 0 else math.nan


class MetricWindow:
    """Everything recorded since the last log. Not thread-safe: record from one thread, or lock around it."""

    def __init__(self) -> None:
        self._items: dict[str, list[float]] = {}
        self._rates: dict[str, list[float]] = {}  # name -> [sum num, sum den, n valid pairs]
        self._gauges: dict[str, list[float]] = {}  # name -> [value, unix time]

    # -- recording -------------------------------------------------------------------------------------------
    def add(self, name: str, value: float) -> None:
        """Record one item (per rollout, sample, call or step)."""
        self._item_list(name).append(float(value))

    def extend(self, name: str, values: Iterable[float]) -> None:
        """Record several items at once (a list, tuple or 1-D numpy array)."""
        self._item_list(name).extend(float(v) for v in values)

    def _item_list(self, name: str) -> list[float]:
        """The items recorded under ``name`` (its kind checked when the window first sees it: the trainer adds
        several items a sample)."""
        items = self._items.get(name)
        if items is None:
            self._check_kind(name, "items")
            items = self._items[name] = []
        return items

    def add_rate(self, name: str, numerator: float, denominator: float) -> None:
        """Record a quantity and what it is per (tokens and seconds, failures and calls, sum and weight)."""
        self._check_kind(name, "rates")
        self._add_pair(name, float(numerator), float(denominator), 1)

    def set_gauge(self, name: str, value: float, at: float | None = None) -> None:
        """Set a gauge; the value with the latest ``at`` (default: now) wins, also across merged processes."""
        self._check_kind(name, "gauges")
        at = time.time() if at is None else float(at)
        old = self._gauges.get(name)
        if old is None or at >= old[1]:
            self._gauges[name] = [float(value), at]

    # -- crossing processes ----------------------------------------------------------------------------------
    def to_payload(self) -> Payload:
        """A plain-data copy of the window (dicts, lists and floats) that pickles across processes."""
        return {
            "items": {k: list(v) for k, v in self._items.items()},
            "rates": {k: list(v) for k, v in self._rates.items()},
            "gauges": {k: list(v) for k, v in self._gauges.items()},
        }

    def take_payload(self) -> Payload:
        """``to_payload()`` then ``reset()``: what a producer process sends at each report."""
        payload = self.to_payload()
        self.reset()
        return payload

    def merge(self, payload: Mapping[str, Mapping[str, Any]]) -> None:
        """Add another window's records (from ``to_payload``) to this one."""
        unknown = set(payload) - set(_KINDS)
        if unknown:
            raise ValueError(
                f"metrics payload has unknown sections {sorted(unknown)}; expected {list(_KINDS)}"
            )
        for name, values in payload.get("items", {}).items():
            self.extend(name, values)
        for name, pair in payload.get("rates", {}).items():
            self._check_kind(name, "rates")
            num, den, n = pair
            self._add_pair(name, num, den, int(n))
        for name, (value, at) in payload.get("gauges", {}).items():
            self.set_gauge(name, value, at)

    # -- reading ---------------------------------------------------------------------------------------------
    def reduce(self) -> dict[str, float]:
        """One value per recorded metric, sorted by name; metrics with no record in the window are absent."""
        out: dict[str, float] = {}
        for name, values in self._items.items():
            if values:
                out[name] = reduce_metric(name, values)
        for name, (num, den, n) in self._rates.items():
            out[name] = reduce_rate(num, den) if n else math.nan
        for name, (value, _) in self._gauges.items():
            out[name] = value
        return dict(sorted(out.items()))

    def reset(self) -> None:
        """Start a new window."""
        self._items.clear()
        self._rates.clear()
        self._gauges.clear()

    def __len__(self) -> int:
        """Number of metric names recorded in the window."""
        return len(self._items) + len(self._rates) + len(self._gauges)

    # -- internals -------------------------------------------------------------------------------------------
    def _add_pair(self, name: str, num: float, den: float, n: int) -> None:
        acc = self._rates.setdefault(name, [0.0, 0.0, 0])
        if n and not (math.isnan(num) or math.isnan(den)):  # a NaN pair is ignored, like a NaN item
            acc[0] += num
            acc[1] += den
            acc[2] += n

    def _check_kind(self, name: str, kind: str) -> None:
        stores = {"items": self._items, "rates": self._rates, "gauges": self._gauges}
        for other, store in stores.items():
            if other != kind and name in store:
                raise ValueError(
                    f"metric {name!r} is recorded as {kind[:-1]} but was already recorded as {other[:-1]} "
                    "in this window; one name must keep one kind"
                )
