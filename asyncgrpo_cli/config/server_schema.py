"""Typed schemas of the ``server`` group: the generation server (embedded, vLLM, vLLM started by the run) and NCCL
weight sync. Split out of ``schema.py`` (which re-exports them); the embedded server's settings also configure a
distillation run's embedded teachers (``teacher.embedded``). Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncgrpo_cli.config.choices import ServeDtype
from asyncgrpo_cli.config.fields import F


@dataclass
class EmbeddedServerConfig:
    host: str = F("127.0.0.1", "Interface the embedded server binds; loopback by default.")
    port: int = F(0, "Port of the embedded server; 0 picks a free port (safe for multirun sweeps).")
    max_model_len: int = F(
        2048, "Longest prompt + completion the embedded server accepts (its max_model_len)."
    )
    max_num_seqs: int = F(32, "Most sequences decoded together in one batch.")
    kv_cache_tokens: int = F(
        65536,
        "Token capacity the server admits at once; reported as vllm:cache_config_info kv_cache_size_tokens.",
    )
    dtype: ServeDtype = F("float32", "Serving dtype (match model.dtype to keep log-probs comparable).")
    num_threads: int | None = F(
        None, "torch threads of the server process; None: half the cores (at least 1)."
    )
    prefix_cache_size: int = F(
        64, "Prompts whose KV the server keeps for reuse (0 disables the prefix cache)."
    )
    device: str = F(
        "cpu",
        "Device the embedded server runs on: cpu, or cuda:N (needed for server.weight_sync=nccl; use another GPU "
        "than the trainer's).",
    )
    enable_lora: bool | None = F(
        None,
        "Serve LoRA adapters loaded at runtime (/v1/load_lora_adapter, like vLLM's --enable-lora); None: on when "
        "server.weight_sync=lora.",
    )


@dataclass
class VllmLaunchConfig:
    python: str | None = F(
        None,
        "Python of the vLLM venv; train runs its vLLM server module. None: $VLLM_PYTHON when set, else the "
        "`vllm` command on PATH.",
    )
    host: str = F("127.0.0.1", "Interface the vLLM server binds; loopback by default.")
    port: int = F(0, "Port of the vLLM server; 0 picks a free port.")
    gpus: list[int] = F(
        help="GPU ids the server uses (CUDA_VISIBLE_DEVICES), tensor-parallel over all of them; []: the CPU "
        "build, or vLLM's default device.",
        factory=list,
    )
    max_model_len: int = F(2048, "--max-model-len: the longest prompt + completion the server accepts.")
    dtype: str = F(
        "float32", "--dtype of the served weights; match model.dtype to keep log-probs comparable."
    )
    max_logprobs: int = F(
        20,
        "--max-logprobs: top log-probs a request may ask for; >= sampling.num_sampler_logprobs (-1: no cap).",
    )
    enforce_eager: bool = F(
        False, "--enforce-eager: no CUDA graphs or compilation (faster start, slower decode)."
    )
    weight_transfer_backend: str | None = F(
        "nccl",
        "--weight-transfer-config backend on GPU builds; never passed to a CPU build (NCCL cannot run there); "
        "null omits the flag.",
    )
    max_lora_rank: int | None = F(
        None,
        "--max-lora-rank, passed with --enable-lora when server.weight_sync=lora; None: model.lora.r rounded up "
        "to a rank vLLM accepts (1, 8, 16, 32, 64, 128, 256, 320, 512).",
    )
    max_loras: int | None = F(
        None,
        "--max-loras (adapters in one batch) when server.weight_sync=lora; None: rollout.max_staleness + 2, the "
        "adapter versions kept loaded.",
    )
    extra_args: list[str] = F(
        help="More vllm serve flags, appended last, e.g. [--gpu-memory-utilization, '0.5'].", factory=list
    )
    env: dict[str, str] = F(
        help="Extra environment of the server process, e.g. {VLLM_CPU_KVCACHE_SPACE: '2'} (GiB of KV cache "
        "on CPU).",
        factory=dict,
    )
    stop_timeout: float = F(
        30.0, "Seconds to wait after SIGTERM before the server's process group is killed."
    )


@dataclass
class NcclSyncConfig:
    packed: bool = F(
        True,
        "Pack consecutive tensors into uint8 buffers, one broadcast per buffer (vLLM's packed mode); false: one "
        "broadcast per tensor.",
    )
    buffer_size_bytes: int = F(
        256 * 1024 * 1024,
        "Packed mode: a buffer is sent once it holds more than this many bytes (vLLM's packed_buffer_size_bytes; "
        "the server follows the trainer's value). Extra GPU memory on each side: about buffer x num_buffers.",
    )
    num_buffers: int = F(
        2,
        "Packed mode: buffers (CUDA streams) in flight, so packing one overlaps sending the previous (>= 1).",
    )
    timeout: float = F(
        600.0,
        "Seconds one transfer may take (POST /update_weights and the broadcast); on expiry the sync fails with "
        "a clear error instead of hanging in NCCL.",
    )
    init_timeout: float = F(
        300.0,
        "Seconds for the NCCL rendezvous with the server (POST /init_weight_transfer_engine and ncclCommInitRank).",
    )


@dataclass
class ServerConfig:
    backend: str = F(
        "embedded",
        "Generation server backend: embedded (started by train), vllm (a URL) or vllm_launch (train starts "
        "vllm serve with the required flags).",
    )
    base_url: str = F("http://localhost:8000", "Base URL of an external server (backend=vllm).")
    timeout: float = F(
        1800.0,
        "Seconds for each generation request and each weight-sync call (vllm_server_timeout); also how long "
        "generation waits for a server that stopped answering (restart) before the run stops.",
    )
    startup_timeout: float = F(
        300.0, "Seconds to wait for the server to become ready before failing with a clear error."
    )
    max_retries: int = F(
        5,
        "Retries (with backoff) of a generation request that timed out or got a 5xx before the run stops; "
        "connection failures are retried until server.timeout instead.",
    )
    weight_sync: str = F(
        "disk",
        "Weight-sync backend: disk (safetensors + reload_weights; merged weights when model.lora is on) or lora "
        "(the LoRA adapter, loaded under a new name per version; merged fallback when it is not servable) or "
        "nccl (GPU to GPU broadcast from the trainer, vLLM's native weight transfer; server.nccl).",
    )
    weight_sync_dir: str | None = F(
        None,
        "Directory the server can read for disk sync; default RUN_DIR/weights (must be shared with the server).",
    )
    verify_sync: bool = F(
        True,
        "After each weight sync, score a fixed probe with the server and the trainer; fail when the mean "
        "log-prob gap exceeds server.verify_sync_tolerance (the sync did not take). Logged as sync/logprob_gap.",
    )
    verify_sync_tolerance: float | None = F(
        None,
        "Mean |log-prob gap| in nats that verify_sync allows; None: by the coarser of the trainer's and the "
        "server's dtype (float32 1e-3, float16 2e-2, bfloat16 5e-2).",
    )
    embedded: EmbeddedServerConfig = F(help="Settings of the embedded server.", factory=EmbeddedServerConfig)
    vllm_launch: VllmLaunchConfig = F(
        help="Settings of the vLLM server that train starts (backend=vllm_launch).", factory=VllmLaunchConfig
    )
    nccl: NcclSyncConfig = F(
        help="Settings of server.weight_sync=nccl (GPU to GPU broadcast, vLLM's native protocol).",
        factory=NcclSyncConfig,
    )
