"""Every registered plugin conforms to its kind's contract (``asyncgrpo_cli/protocols.py``).

Importing a plugin's module may import torch: fine here. A new kind with a contract adds a row to
``KIND_PROTOCOLS``.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from asyncgrpo_cli import registry
from asyncgrpo_cli.config.compose import compose_config
from asyncgrpo_cli.config.schema import ServerConfig
from asyncgrpo_cli.protocols import ServerBackend, WeightSync

KIND_PROTOCOLS: dict[str, type] = {
    "server": ServerBackend,
    "weight_sync": WeightSync,
}


def members(proto: type) -> dict[str, object]:
    """The protocol's declared members: annotated attributes (value None) and methods (their function)."""
    out: dict[str, object] = dict.fromkeys(getattr(proto, "__annotations__", {}))
    for name, value in vars(proto).items():
        if isinstance(value, (classmethod, staticmethod)):
            out[name] = value.__func__
        elif inspect.isfunction(value):
            out[name] = value
    return {k: v for k, v in out.items() if not k.startswith("_")}


def has(cls: type, member: str) -> bool:
    """A class attribute, or an instance attribute the class declares (``base_url: str``, set by ``start``)."""
    return hasattr(cls, member) or any(member in getattr(k, "__annotations__", {}) for k in cls.__mro__[:-1])


def _positional(fn: object) -> list[str]:
    params = list(inspect.signature(fn).parameters.values())
    return [p.kind.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]


def plugins() -> list[tuple[str, str]]:
    return [(kind, name) for kind in KIND_PROTOCOLS for name in registry.names(kind)]


def test_every_kind_with_a_contract_is_a_registry_kind():
    assert set(KIND_PROTOCOLS) <= set(registry.KINDS)
    assert all(getattr(p, "_is_runtime_protocol", False) for p in KIND_PROTOCOLS.values())


@pytest.mark.parametrize(("kind", "name"), plugins(), ids=lambda v: f"{v}")
def test_registered_plugin_conforms(kind, name):
    cls = registry.resolve(kind, name)
    proto = KIND_PROTOCOLS[kind]
    declared = members(proto)
    missing = [m for m in declared if not has(cls, m)]
    assert missing == [], f"{kind} {name!r} ({cls.__qualname__}) lacks {missing} of {proto.__name__}"
    for member, fn in declared.items():
        if fn is None:
            continue
        mine = inspect.getattr_static(cls, member)
        assert isinstance(mine, classmethod) == isinstance(inspect.getattr_static(proto, member), classmethod)
        assert _positional(getattr(cls, member)) == _positional(getattr(proto, member)), (
            f"{kind} {name!r}: {member}{inspect.signature(getattr(cls, member))} does not take what "
            f"{proto.__name__}.{member}{inspect.signature(getattr(proto, member))} takes"
        )


def test_the_check_sees_a_missing_member():
    class Incomplete:
        passes_vllm_flags = False
        base_url = control = None

        def start(self): ...

        def stop(self): ...

    assert [m for m in members(ServerBackend) if not has(Incomplete, m)] == [
        "check_alive",
        "plan",
        "probe_preview",
        "max_model_len_fix",
    ]


@pytest.mark.parametrize("name", registry.names("weight_sync"), ids=lambda n: f"weight_sync={n}")
def test_built_weight_sync_is_a_weight_sync(name, tmp_path: Path):
    """Built the way ``train`` builds it (rank 0 without a server: nothing is sent), its optional hooks are
    declared: ``None`` until it has something to offer."""
    from asyncgrpo_cli.train.distributed import DistInfo

    cfg = compose_config(["+recipe=tiny"])
    sync = registry.resolve("weight_sync", name).build(cfg, None, tmp_path / "weights", DistInfo())
    try:
        assert isinstance(sync, WeightSync)
        assert sync.repush is None and sync.served_name_template is None and sync.served_name(1) is None
        assert sync.control is None
    finally:
        sync.close()


@pytest.mark.parametrize("name", registry.names("server"), ids=lambda n: f"server={n}")
def test_server_backend_answers_the_probe_before_it_is_built(name):
    cls = registry.resolve("server", name)
    where, max_model_len = cls.plan(ServerConfig())
    assert isinstance(where, str) and (max_model_len is None or max_model_len > 0)
    assert isinstance(cls.passes_vllm_flags, bool)
    assert "sampling.max_completion_length" in cls.max_model_len_fix(4096, 2048)
