"""LoRA on the embedded server over real HTTP (a subprocess started with ``--enable-lora`` on the tiny model):
vLLM's load / unload routes with their shapes and errors, completions under an adapter's name equal to the PEFT
model, and the ``lora`` weight sync against it: a new name per version, ``max_staleness + 2`` kept, older versions
unloaded and their directories deleted one sync later, each sync checked by the weight-sync check under the
adapter's name, a restart's reload, and the merged-weight fallback for an adapter that is not servable."""

from __future__ import annotations

import httpx
import pytest
import torch

from asyncgrpo_cli.config.schema import EmbeddedServerConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.server.control import ServerControl
from asyncgrpo_cli.server.launch import EmbeddedServerProcess
from asyncgrpo_cli.sync.lora import LoraSyncSettings, LoraWeightSync
from asyncgrpo_cli.sync.verify import WeightSyncMismatchError, verify_weight_sync
from tests.test_lora import lora_model, tiny_cfg, write_version

pytestmark = pytest.mark.slow

NAME = "tiny"
PROMPT = [17, 250, 31, 999, 4, 86, 512, 77]
SERVER = {"enable_lora": True}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Reference forwards on one thread (see the conftest fixture)."""


@pytest.fixture(scope="module")
def control(server):
    c = ServerControl(server.base_url, timeout=60)
    yield c
    c.close()


def greedy(client: httpx.Client, model: str, max_tokens: int = 8) -> tuple[int, dict]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
    }
    resp = client.post("/v1/completions", json=body)
    return resp.status_code, resp.json()


def reference_logprobs(model, output_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + output_ids])).logits[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(output_ids)[:, None]).squeeze(-1)


def adapters(client: httpx.Client) -> dict[str, dict]:
    return {c["id"]: c for c in client.get("/v1/models").json()["data"] if c["parent"]}


def test_load_unload_and_serve_like_vllm(client, tiny_model_dir, tmp_path):
    trained = lora_model(tiny_model_dir, seed=1)
    path = write_version(trained, tmp_path / "a")
    load = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": path})
    assert load.status_code == 200 and load.text == "Success: LoRA adapter 'a' added successfully."
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": path})
    assert again.status_code == 400 and again.json()["error"]["type"] == "InvalidUserInput"
    assert "has already been loaded" in again.json()["error"]["message"]
    base = client.post("/v1/load_lora_adapter", json={"lora_name": NAME, "lora_path": path})
    assert base.status_code == 400 and "conflicts with a served base model" in base.text
    missing = client.post(
        "/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": str(tmp_path / "none")}
    )
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    assert "No adapter found for" in missing.json()["error"]["message"]
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400

    card = adapters(client)["a"]
    assert card["parent"] == NAME and card["root"] == path and card["object"] == "model"
    status, out = greedy(client, "a")
    assert status == 200 and out["model"] == "a"
    ids = out["choices"][0]["token_ids"]
    lp = torch.tensor(out["choices"][0]["logprobs"]["token_logprobs"])
    assert torch.allclose(lp, reference_logprobs(trained, ids), atol=1e-4)
    _, plain = greedy(client, NAME)
    assert plain["model"] == NAME and plain["choices"][0]["logprobs"]["token_logprobs"] != lp.tolist()

    other = lora_model(
        tiny_model_dir, seed=2
    )  # in place: same name, new weights, nothing stale from the cache
    inplace = {"lora_name": "a", "lora_path": write_version(other, tmp_path / "b"), "load_inplace": True}
    assert client.post("/v1/load_lora_adapter", json=inplace).status_code == 200
    _, out = greedy(client, "a")
    ids = out["choices"][0]["token_ids"]
    lp = torch.tensor(out["choices"][0]["logprobs"]["token_logprobs"])
    assert torch.allclose(lp, reference_logprobs(other, ids), atol=1e-4)
    body = {
        "model": "a",
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 6, "temperature": 0.0, "logprobs": 0},
    }
    gen = client.post("/inference/v1/generate", json=body)  # the sampling-mask route serves adapters too
    assert gen.status_code == 200 and gen.json()["model"] == "a", gen.text
    choice = gen.json()["choices"][0]
    lp = torch.tensor([t["logprob"] for t in choice["logprobs"]["content"]])
    assert torch.allclose(lp, reference_logprobs(other, choice["token_ids"]), atol=1e-4)

    unload = client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert unload.status_code == 200 and unload.text == "Success: LoRA adapter 'a' removed successfully."
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert gone.status_code == 404 and "The lora adapter 'a' cannot be found." in gone.text
    status, out = greedy(client, "a")
    assert status == 404 and out["error"]["message"] == "The model `a` does not exist."
    info = client.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["lora_config"]["max_loras"] is None and info["lora_config"]["max_lora_rank"] == 512
    assert client.get("/v1/load_lora_adapter").status_code == 405  # what the startup probe asks


def test_lora_sync_loads_each_version_under_a_new_name_and_retires_old_ones(
    control, client, tiny_model_dir, tmp_path
):
    model, tokenizer = lora_model(tiny_model_dir, seed=3), _tokenizer(tiny_model_dir)
    server_cfg = tiny_cfg().server
    sync = LoraWeightSync(
        control, LoraSyncSettings(tmp_path / "adapters", tmp_path / "weights", max_staleness=1)
    )
    root = tmp_path / "adapters"
    try:
        for version in range(5):
            with torch.no_grad():  # a training step
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(torch.randn_like(p) * 0.05)
            timings = sync.push(model, version)
            assert (
                sync.served_name(version) == f"policy-v{version}" and timings["perf/weight_sync_pause_s"] == 0
            )
            metrics = verify_weight_sync(server_cfg, sync, model, tokenizer, version)
            assert metrics["sync/logprob_gap"] < 1e-4, metrics
            kept = [f"policy-v{v}" for v in range(max(0, version - 2), version + 1)]  # max_staleness + 2 = 3
            assert sorted(adapters(client)) == kept and sync.loaded == list(
                range(max(0, version - 2), version + 1)
            )
            on_disk = sorted(p.name for p in root.iterdir())
            assert on_disk == [
                f"v{v:06d}" for v in range(max(0, version - 3), version + 1)
            ]  # deleted a sync later
            assert not list(root.glob(".*.tmp"))
        status, _ = greedy(client, "policy-v1")
        assert status == 404  # retired

        with torch.no_grad():  # trained, but the sync is skipped: the check sees it under the adapter's name
            for p in model.parameters():
                if p.requires_grad:
                    p.mul_(3.0)
        with pytest.raises(WeightSyncMismatchError, match=r"version 4 did not take.*under 'policy-v4'"):
            verify_weight_sync(server_cfg, sync, model, tokenizer, 4)

        for name in adapters(client):  # a restarted server has none of them
            client.post("/v1/unload_lora_adapter", json={"lora_name": name})
        sync.repush(4)
        assert sorted(adapters(client)) == ["policy-v2", "policy-v3", "policy-v4"]
        assert client.get("/weight_info").json() == {"weight_version": "v4"}
    finally:
        sync.close()
        for name in adapters(client):
            client.post("/v1/unload_lora_adapter", json={"lora_name": name})
    assert not list(root.iterdir())


def test_leftovers_of_an_earlier_run_are_unloaded(control, client, tiny_model_dir, tmp_path):
    model = lora_model(tiny_model_dir, seed=4)
    stale = write_version(lora_model(tiny_model_dir, seed=5), tmp_path / "stale")
    client.post("/v1/load_lora_adapter", json={"lora_name": "policy-v0", "lora_path": stale})
    client.post("/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": stale})  # not ours: kept
    sync = LoraWeightSync(
        control, LoraSyncSettings(tmp_path / "adapters", tmp_path / "weights", max_staleness=0)
    )
    try:
        sync.push(model, 0)
        assert adapters(client)["policy-v0"]["root"].endswith("v000000") and "mine" in adapters(client)
    finally:
        sync.close()
        for name in adapters(client):
            client.post("/v1/unload_lora_adapter", json={"lora_name": name})


def test_an_unservable_adapter_falls_back_to_merged_weights(control, client, tiny_model_dir, tmp_path):
    model, tokenizer = lora_model(tiny_model_dir, seed=6, use_dora=True), _tokenizer(tiny_model_dir)
    sync = LoraWeightSync(
        control, LoraSyncSettings(tmp_path / "adapters", tmp_path / "weights", max_staleness=1)
    )
    try:
        sync.push(model, 1)
        assert sync.decision.mode == "merged" and "use_dora" in sync.decision.reason
        assert sync.served_name(1) is None and sync.served_name_template is None and sync.repush is None
        assert adapters(client) == {} and (tmp_path / "weights" / "v000001").is_dir()
        assert verify_weight_sync(tiny_cfg().server, sync, model, tokenizer, 1)["sync/logprob_gap"] < 1e-4
    finally:
        sync.close()
        control.collective_rpc(
            "reload_weights", {"weights_path": str(tiny_model_dir)}
        )  # the base model again


def test_a_server_without_lora_is_a_clear_error(tiny_model_dir, tmp_path):
    cfg = EmbeddedServerConfig(port=0, max_model_len=256, max_num_seqs=4, num_threads=1)
    proc = EmbeddedServerProcess(
        tiny_model_dir, cfg, served_model_name=NAME, log_path=tmp_path / "s.log", startup_timeout=120
    )
    proc.start()
    control = ServerControl(proc.base_url, timeout=60)
    try:
        from asyncgrpo_cli.server.probe import probe_server

        lora_cfg = tiny_cfg("model.lora.enabled=true", "server.weight_sync=lora")
        with pytest.raises(
            UserError, match=r"started without --enable-lora\) \(fix: server.embedded.enable_lora=true\)"
        ):
            probe_server(control, lora_cfg)
        resp = httpx.post(f"{proc.base_url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert resp.status_code == 404 and "--enable-lora" in resp.json()["error"]["message"]
    finally:
        control.close()
        proc.stop()


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
