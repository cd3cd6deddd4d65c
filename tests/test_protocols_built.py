"""Every registered loss and packer, built from its default sub-config as the trainer builds it, conforms to its
protocol (``asyncgrpo_cli/protocols.py``) by members and call signatures; the checker rejects plugins that do not.
Server backends and weight syncs (checked as classes: they need a server to build) are ``test_protocols.py``."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

import pytest

from asyncgrpo_cli import registry
from asyncgrpo_cli.config.schema import LossConfig, PackingConfig
from asyncgrpo_cli.protocols import Loss, Packer, Planner

KIND_PROTOCOLS: dict[str, type] = {"loss": Loss, "packer": Packer}
"""Plugin kind -> the protocol every registered plugin of that kind conforms to."""

BUILDERS: dict[str, Callable[[Any], Any]] = {
    "loss": lambda cls: cls(LossConfig()),
    "packer": lambda cls: cls(PackingConfig()),
}
"""Plugin kind -> how the trainer builds one (from its own default sub-config), for the conformance check."""


def _members(proto: type) -> dict[str, Any]:
    """The protocol's declared members: annotated attributes (name -> type) and methods (name -> function)."""
    out: dict[str, Any] = dict(typing.get_type_hints(proto))
    for name, value in vars(proto).items():
        if name == "__call__" or name == "__len__" or not name.startswith("_"):
            out[name] = value
    return out


def _params(fn: Any, bound: bool) -> list[inspect.Parameter]:
    params = list(inspect.signature(fn).parameters.values())
    return params if bound else params[1:]  # a protocol's function still lists self / cls


def protocol_problems(obj: Any, proto: type) -> list[str]:
    """What keeps ``obj`` from conforming to ``proto`` (empty when it conforms)."""
    problems = []
    for name, decl in _members(proto).items():
        if not hasattr(obj, name):
            problems.append(f"missing {name!r}")
            continue
        value = getattr(obj, name)
        if isinstance(decl, property):
            continue
        if isinstance(decl, (staticmethod, classmethod)) or inspect.isfunction(decl):
            fn = decl.__func__ if isinstance(decl, (staticmethod, classmethod)) else decl
            want = _params(fn, bound=isinstance(decl, staticmethod))
            got = _params(value, bound=True)
            names = [p.name for p in got[: len(want)]]
            extra = [p.name for p in got[len(want) :] if p.default is p.empty and p.kind != p.VAR_KEYWORD]
            if names != [p.name for p in want] or extra:
                problems.append(
                    f"{name}{inspect.signature(value)} does not match {name}{inspect.signature(fn)}"
                )
            continue
        origin = typing.get_origin(decl) or decl
        if origin is types.UnionType:  # e.g. float | None
            if not isinstance(value, typing.get_args(decl)):
                problems.append(f"{name} is {value!r}, not a {decl}")
            continue
        if not isinstance(value, origin):
            problems.append(f"{name} is {value!r}, not a {decl}")
        elif origin is tuple and not all(isinstance(v, str) for v in value):
            problems.append(f"{name} must hold names (str), got {value!r}")
    return problems


def _registered(kind: str) -> list[registry.PluginSpec]:
    return registry.specs(kind)


@pytest.mark.parametrize(
    ("kind", "name"), [(kind, spec.name) for kind in KIND_PROTOCOLS for spec in _registered(kind)]
)
def test_registered_plugin_conforms(kind, name):
    plugin = BUILDERS[kind](registry.resolve(kind, name))
    assert protocol_problems(plugin, KIND_PROTOCOLS[kind]) == []
    assert isinstance(plugin, KIND_PROTOCOLS[kind])


@pytest.mark.parametrize("name", [spec.name for spec in _registered("packer")])
def test_packer_planner_conforms(name):
    from asyncgrpo_cli.packing import planner_for

    packer = BUILDERS["packer"](registry.resolve("packer", name))
    planner = planner_for(packer)(64, num_ranks=2)
    assert protocol_problems(planner, Planner) == []


def test_every_kind_with_a_protocol_is_built():
    assert set(KIND_PROTOCOLS) <= set(registry.KINDS) and set(KIND_PROTOCOLS) == set(BUILDERS)
    assert all(_registered(kind) for kind in KIND_PROTOCOLS)


class _LossBase:
    head_temperature = None

    def metric_records(self, raw):
        return {}, {}


class _NoNeeds(_LossBase):
    def __call__(self, stats, row, num_trained_step):
        return stats.logprobs.sum(), {}


class _BadCall(_LossBase):
    needs = ("sampler_topk",)

    def __call__(self, stats, row):
        return stats.logprobs.sum(), {}


class _NeedsNotNames(_LossBase):
    needs = "sampler_topk"

    def __call__(self, stats, row, num_trained_step):
        return stats.logprobs.sum(), {}


class _TemperatureNotAFloat(_LossBase):
    needs = ()
    head_temperature = "1.0"

    def __call__(self, stats, row, num_trained_step):
        return stats.logprobs.sum(), {}


class _BadPacker:
    planner = "asyncgrpo_cli.packing.planner:TokenBudgetPlanner"

    def pack(self, samples, budget):
        raise NotImplementedError


def test_checker_rejects_nonconforming_plugins():
    assert protocol_problems(_NoNeeds(), Loss) == ["missing 'needs'"]
    assert "does not match" in protocol_problems(_BadCall(), Loss)[0]
    assert "not a tuple" in protocol_problems(_NeedsNotNames(), Loss)[0]
    assert "head_temperature is '1.0'" in protocol_problems(_TemperatureNotAFloat(), Loss)[0]
    assert "does not match" in protocol_problems(_BadPacker(), Packer)[0]
    assert protocol_problems(object(), Packer) == ["missing 'planner'", "missing 'pack'"]


def test_protocols_and_samples_import_no_torch():
    code = (
        "import sys, asyncgrpo_cli.protocols, asyncgrpo_cli.samples; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
