"""Typed schemas behind every config group. Imports no torch.

Each group under ``conf/`` has one dataclass here (the ``server`` group's live in ``server_schema.py`` and are
re-exported); ``RootConfig`` ties them together. Field docs live on the
field (``help``) so ``asyncgrpo check --explain GROUP`` can print them. Components receive only their own
sub-config. A field whose valid values are a fixed set is typed with a choice type from ``config/choices.py``
(validation and ``--explain`` read the values from it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncgrpo_cli.config.choices import (
    Algorithm,
    AttnImplementation,
    ConsoleMode,
    Dtype,
    FlexBackend,
    LinearAttentionKernel,
    LmHeadKernel,
    LoraBias,
    LrSchedulerType,
    MixedPrecision,
    OneRankCast,
    SamplingMask,
    SinkName,
    ToolCallFormat,
    TrainCompile,
    TrainDevice,
    choice_of,
)
from asyncgrpo_cli.config.fields import F
from asyncgrpo_cli.config.harness import HarnessConfig
from asyncgrpo_cli.config.server_schema import (  # the server group's schemas, re-exported
    EmbeddedServerConfig as EmbeddedServerConfig,
)
from asyncgrpo_cli.config.server_schema import NcclSyncConfig as NcclSyncConfig
from asyncgrpo_cli.config.server_schema import ServerConfig as ServerConfig
from asyncgrpo_cli.config.server_schema import VllmLaunchConfig as VllmLaunchConfig

ATTN_CHOICES: tuple[str, ...] = choice_of(AttnImplementation).values  # type: ignore[union-attr]
"""Values of ``model.attn_implementation`` (``model/flex.py`` maps them to transformers' implementations)."""


@dataclass
class LoraConfig:
    enabled: bool = F(
        False,
        "Train a PEFT LoRA adapter instead of the full model (only adapter parameters reach the optimizer). "
        "server.weight_sync=lora pushes the adapter; server.weight_sync=disk pushes merged full weights.",
    )
    r: int = F(
        16, "Adapter rank; vLLM serves it under --max-lora-rank (1, 8, 16, 32, 64, 128, 256, 320, 512)."
    )
    alpha: float = F(32.0, "lora_alpha: the adapter's output is scaled by alpha / r.")
    dropout: float = F(0.0, "lora_dropout on the adapter's input while training (none at inference).")
    target_modules: list[str] = F(
        help="Module names (suffixes) that get an adapter, or [all-linear] (every linear layer but the LM head). "
        "lm_head and embed_tokens cannot be targeted: the chunked LM head reads the base weight.",
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    use_rslora: bool = F(False, "Rank-stabilized scaling alpha / sqrt(r) instead of alpha / r.")
    use_dora: bool = F(
        False, "DoRA (weight-decomposed LoRA). Not servable as an adapter: merged weights are pushed instead."
    )
    bias: LoraBias = F(
        "none", "Train biases too: none, all or lora_only. Only none is servable as an adapter (else merged)."
    )
    modules_to_save: list[str] = F(
        help="Modules trained in full next to the adapter. Not servable as an adapter: merged weights are pushed.",
        factory=list,
    )


@dataclass
class ModelConfig:
    name_or_path: str = F(
        "builtin:smollm2-135m-instruct",
        "Hub id, local directory saved with save_pretrained, or a built-in model "
        "('builtin:tiny-qwen3', 'builtin:smollm2-135m-instruct', built offline and cached).",
    )
    revision: str | None = F(None, "Hub revision for the model and tokenizer.")
    trust_remote_code: bool = F(False, "Allow custom code from the Hub (model and tokenizer).")
    dtype: Dtype = F(
        "float32",
        "Trainer load dtype: auto, bfloat16, float16 or float32. fp32 keeps the training-inference mismatch "
        "small; serve the model at the same dtype.",
    )
    gradient_checkpointing: bool = F(True, "Recompute activations in backward to save memory.")
    attn_implementation: AttnImplementation = F(
        "auto",
        "Attention for training: auto (flex_attention on CUDA, sdpa elsewhere), sdpa, eager, or flex_attention "
        "(compiled, block-sparse packed-row masks; CUDA only).",
    )
    flex_kernel_options: dict[str, Any] = F(
        help="Triton kernel options of flex attention (torch's FlexKernelOptions; fwd_ / bwd_ prefixes reach one "
        "pass), e.g. '+model.flex_kernel_options={fwd_BLOCK_M:64,fwd_BLOCK_N:64,fwd_num_warps:4}'. Empty: see "
        "model.flex_tuned_options. `asyncgrpo bench attention` measures candidates on packed rows.",
        factory=dict,
    )
    flex_tuned_options: bool = F(
        True,
        "With model.flex_kernel_options empty: flex attention uses the tiles measured fastest for the GPU and head "
        "size (model/flex.py TUNED_OPTIONS; sm90 (H100 / H200), head dim 128, 16-bit: forward 64x64, 3 stages, 4 "
        "warps), elsewhere torch's own table; false: torch's table everywhere.",
    )
    flex_backend: FlexBackend = F(
        "auto",
        "Kernels of flex attention: triton (torch's Triton templates, tiles as model.flex_kernel_options / "
        "model.flex_tuned_options say), flash (FlashAttention-4's CuTe kernels, torch's FLASH backend of flex "
        "attention; 16-bit heads on Hopper / Blackwell GPUs; needs the flash-attn-4 package: pip install "
        "'asyncgrpo[flash]'), or auto (flash where flash-attn-4 is installed, the GPU is Hopper / Blackwell, it has "
        "kernels for the model's head dim, model.flex_kernel_options is empty and FlashAttention-4 passes a first-use "
        "check against SDPA; else triton).",
    )
    linear_attention_kernel: LinearAttentionKernel = F(
        "auto",
        "Gated-DeltaNet layers of hybrid models (Qwen3.5, Qwen3-Next): auto (fla's Triton kernels on CUDA when "
        "fla-core is installed, else the pure-torch chunked path), torch, or fla. Both are exact under sequence "
        "and tree packing.",
    )
    lm_head_kernel: LmHeadKernel = F(
        "auto",
        "LM head of the trainer's log-probs: auto (the fused Triton kernels on CUDA when Triton is installed, else "
        "the chunked torch head), torch (chunked head), or triton (fused; CUDA only). Neither forms [tokens, vocab] "
        "logits; rows with sampling candidate sets use the chunked head.",
    )
    served_model_name: str | None = F(
        None, "Model name on the generation server; default: what the server lists first in /v1/models."
    )
    chat_template_kwargs: dict[str, Any] = F(
        help="Extra kwargs for apply_chat_template (e.g. {enable_thinking: false}).", factory=dict
    )
    lora: LoraConfig = F(help="LoRA adapter training (PEFT).", factory=LoraConfig)


@dataclass
class SamplingConfig:
    num_generations: int = F(8, "Rollouts sampled per prompt (G).")
    max_completion_length: int = F(2048, "Max generated tokens per request (per turn).")
    temperature: float = F(
        1.0, "Sampling temperature; the trainer computes log-probs at the same temperature."
    )
    top_p: float = F(1.0, "Nucleus threshold in (0, 1]; 1.0 keeps every token.")
    top_k: int = F(0, "Top-k filter; 0 disables.")
    min_p: float = F(0.0, "Min-p filter in [0, 1]; 0 disables.")
    repetition_penalty: float = F(1.0, "Repetition penalty; 1.0 disables.")
    num_sampler_logprobs: int = F(
        8,
        "Top log-probs requested per generated token (score centering); capped by the server's --max-logprobs.",
    )
    seed_per_request: bool = F(
        True,
        "Send a unique sampling seed with every request (data-parallel engines). Set false for vLLM's CPU "
        "build: seeded requests under concurrency kill its engine (the startup probe refuses the combination).",
    )
    seed: int = F(0, "Base of the per-request seeds.")
    sampling_mask: SamplingMask = F(
        "auto",
        "Candidate sets of truncated sampling (top_k / top_p / min_p; reference section j): auto = request each "
        "token's set through /inference/v1/generate when the server returns them (vLLM --return-sampling-mask "
        "--enable-scale-out; the embedded server always does) and renormalize the trainer's log-probs over it, "
        "else warn once that importance ratios are biased; required = the startup probe fails without server "
        "support; off = never request them (biased ratios, warned once).",
    )
    max_mask_candidates: int = F(
        1024,
        "Largest candidate set kept per token (4 bytes per id in the rollout queue; the trainer pads a row's sets "
        "to (tokens x largest set) int64). A larger set is dropped and its token normalized over the full "
        "vocabulary (counted in rollout/sampling_mask_overflow_frac). On vLLM sets are bounded by top_k.",
    )

    @property
    def truncates(self) -> bool:
        """Whether top_k / top_p / min_p restrict the sampling distribution (greedy sampling never does)."""
        return self.temperature >= 1e-5 and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


@dataclass
class PackingConfig:
    kind: str = F(
        "tree",
        "Packer: tree (default: a prefix trie per row, each shared prefix forwarded once, exact tree attention) "
        "or sequence (padding-free rows with per-sample attention isolation).",
    )
    share_across_groups: bool = F(
        True,
        "Tree packing: groups in one row share the prefixes their prompts have in common (a system prompt, "
        "few-shot examples), forwarded once per row instead of once per group; exact either way. false: one trie "
        "per group (the layout before cross-group sharing, for comparisons).",
    )
    token_budget: int | None = F(
        None,
        "Max forwarded tokens in one row (one rank's micro-batch); None: the server's max_model_len; <= 0: no "
        "token budget, each micro-batch takes packing.samples_per_row samples per rank (Σ L² balanced).",
    )
    samples_per_row: int = F(
        8, "Samples per row when packing.token_budget <= 0 (per_device_train_batch_size)."
    )


@dataclass
class RewardsConfig:
    funcs: list[Any] = F(
        help="Reward functions, summed with weight 1: registered names, 'module:object' import paths, or "
        "{name: ..., **options} for configurable rewards.",
        factory=lambda: ["accuracy"],
    )


@dataclass
class LossConfig:
    name: str = F(
        "score_centering",
        "Loss plugin: score_centering (GRPO default) or clipped, jsd (asyncgrpo distill), or module:object.",
    )
    epsilon: float = F(0.2, "Lower trust-region epsilon (epsilon_low).")
    epsilon_high: float | None = F(
        None, "Upper trust-region epsilon; None: same as epsilon (DAPO uses 0.28)."
    )
    vllm_importance_sampling_clip_min: float = F(
        0.5, "Tokens whose trainer/sampler ratio is below this are masked out of the loss."
    )
    vllm_importance_sampling_clip_max: float = F(
        5.0, "Tokens whose trainer/sampler ratio is above this are masked out of the loss."
    )
    beta: float = F(
        0.0,
        "jsd: generalized JSD interpolation in [0, 1]: 0 forward KL(teacher || student) over the teacher's top-k "
        "(default), 1 reverse KL (MOPD stage 3), in between the mixture form over the teacher's top-1 and the "
        "sampled token.",
    )
    add_tail_bucket: bool = F(
        True,
        "jsd: add the mass outside the support, log(1 - sum exp(support log-probs)), as one more outcome on both "
        "sides; false renormalizes both over the support.",
    )
    teacher_temperature: float = F(
        1.0,
        "jsd: temperature of both distributions: the student's logits are divided by it (full vocabulary, "
        "exact) and the teacher's reported log-probs are tempered client-side (exact at 1.0; vLLM computes "
        "prompt log-probs before its sampler, so a server never applies it).",
    )
    router_aux_loss_coef: float | None = F(
        None,
        "MoE models: coefficient of the router's auxiliary load-balancing loss added to the training loss (logged "
        "raw as aux_loss); None: the model config's router_aux_loss_coef; 0 disables. Setting it for a dense "
        "model fails at trainer start.",
    )


@dataclass
class RolloutConfig:
    loop: str = F(
        "default", "Rollout loop class: a registered name or module:Class (subclass of AsyncRolloutLoop)."
    )
    loop_options: dict[str, Any] = F(
        help="Extra settings for a custom rollout loop (its hooks read self.options).", factory=dict
    )
    max_concurrent_rollouts: int = F(512, "Hard cap on rollouts in flight.")
    adaptive_concurrency: bool = F(
        True,
        "Follow the server's KV-cache load (reference h.2): start at KV-cache tokens / max_model_len rollouts, "
        "+25% while usage < 60% and nothing waits (once per cap-many finished rollouts), -30% above 80%; never "
        "above max_concurrent_rollouts, which is the cap when off or when the server has no /metrics.",
    )
    metrics_poll_interval_s: float = F(
        5.0,
        "Seconds between polls of the server's /metrics (adaptive cap and the rollout/vllm_* metrics); > 0.",
    )
    max_staleness: int = F(
        4,
        "Max weight updates a sample may lag; generation is also held to max(max_staleness,1) steps of tokens.",
    )
    weight_sync_steps: int = F(1, "Optimizer steps between weight syncs to the server.")
    rollout_worker_timeout: float = F(
        300.0, "Seconds without a heartbeat from the rollout process before training stops."
    )
    score_queue_maxsize: int = F(16, "Finished groups waiting for scoring before generation blocks.")
    start_timeout: float = F(300.0, "Seconds to wait for the rollout process to start.")
    tools: list[str] = F(
        help="Tools the model may call: registered names (calculator) or module:function import paths of plain "
        "module-level functions, sync or async, with type hints and a Google-style docstring (the tool schema). "
        "Sync tools run on a pool of max_concurrent_rollouts threads.",
        factory=list,
    )
    environment_factory: Any = F(
        None,
        "An environment per rollout: a registered name (increment) or module:Class whose reset(**row_columns) "
        "-> str | None starts a rollout, optional get_reward() is a reward source (rewards/<ClassName>/mean), "
        "and every other public method is a tool; or {name: factory, ...} routed by the dataset's "
        "'environment' column (each row sees only its environment's tools).",
    )
    max_tool_calling_iterations: int | None = F(
        None, "Tool-calling rounds per rollout; None: until a reply calls no tool."
    )
    tool_call_format: ToolCallFormat = F(
        "hermes", "How tool calls are written: hermes (<tool_call>{json}</tool_call>)."
    )
    tool_timeout_s: float = F(
        300.0,
        "Seconds a tool call may run; a slower call fails (its result says so) and the rollout goes on.",
    )
    require_prefix_preserving_template: bool = F(
        False,
        "Fail at startup when the chat template re-renders earlier turns differently (forks cost forward "
        "tokens); false warns. Known families (ChatML, Qwen3) get a shipped training template instead.",
    )

    harness: HarnessConfig = F(
        help="An agent program run once per rollout against a recording OpenAI-compatible proxy (its own loop, "
        "tools and reward): rollout.harness.command=[python, my_agent.py].",
        factory=HarnessConfig,
    )

    @property
    def has_agents(self) -> bool:
        """Whether rollouts may call tools (tools or environments configured)."""
        return bool(self.tools) or bool(self.environment_factory)

    @property
    def renders_tools(self) -> bool:
        """Whether rollouts render tool schemas and tool messages (the tool loop or a harness): the chat template
        must then be a training template (``rollout/agent/templates.py``)."""
        return self.has_agents or self.harness.enabled


@dataclass
class ProfileConfig:
    steps: list[int] = F(
        help="Optimizer steps to record with torch.profiler (e.g. [5,6]: one trace of both); empty: off. Each rank "
        "writes profile/steps-A-B-rank-R.json.gz (a Chrome / Perfetto trace) and a .txt summary (kernel time by "
        "kind, the top kernels, against the steps' wall time) into the run directory.",
        factory=list,
    )
    record_shapes: bool = F(False, "Record operator input shapes in the trace (larger traces).")
    with_stack: bool = F(False, "Record operators' Python stacks (much larger traces, slower steps).")
    top: int = F(30, "Kernels (operators, on CPU) listed in the summary.")


@dataclass
class TrainerConfig:
    learning_rate: float = F(1e-6, "AdamW learning rate.")
    lr_scheduler_type: LrSchedulerType = F(
        "constant", "LR schedule: constant, constant_with_warmup, linear or cosine."
    )
    warmup_steps: int = F(0, "Warmup steps of the LR schedule.")
    weight_decay: float = F(0.0, "AdamW weight decay.")
    adam_beta1: float = F(0.9, "AdamW beta1.")
    adam_beta2: float = F(0.999, "AdamW beta2.")
    adam_epsilon: float = F(1e-8, "AdamW epsilon.")
    max_grad_norm: float = F(1.0, "Gradient clipping norm; 0 disables.")
    gradient_accumulation_steps: int = F(1, "Micro-batches per optimizer step.")
    num_train_epochs: float = F(
        1.0, "Passes over the prompts (distinct prompts consumed); used when max_steps <= 0."
    )
    max_steps: int = F(-1, "Optimizer steps to run; > 0 overrides num_train_epochs.")
    save_steps: int = F(500, "Save a checkpoint every N optimizer steps (0: only at the end).")
    save_total_limit: int | None = F(None, "Keep at most this many checkpoints (oldest deleted).")
    save_final: bool = F(True, "Save a checkpoint when training ends.")
    resume: str | None = F(
        None, "Resume from a checkpoint: 'auto' (latest in the run dir) or a checkpoint path."
    )
    seed: int = F(42, "Seed for the trainer (init, data order).")
    save_hf_model: bool = F(
        True, "Also write the policy as an HF model directory (checkpoint/model) in checkpoints."
    )
    mixed_precision: MixedPrecision | None = F(
        None,
        "bfloat16: fp32 master weights (model.dtype=float32) computed in bf16, gradients reduced in fp32 (FSDP2, "
        "also on one GPU); null: compute in model.dtype.",
    )
    cpu_offload: bool = F(
        False,
        "FSDP2 on CUDA: keep sharded parameters, gradients and optimizer state in CPU memory (AdamW steps on the "
        "CPU): less GPU memory, slower steps.",
    )
    reshard_after_forward: bool = F(
        True,
        "FSDP2: free each layer's gathered parameters after its forward and gather them again for backward; false "
        "keeps them until backward (one all-gather less per step, more GPU memory).",
    )
    one_rank_cast: OneRankCast = F(
        "foreach",
        "FSDP2 on one GPU: foreach casts all of a layer's fp32 parameters to the compute dtype in one launch before "
        "its forward and backward (train/one_rank_cast.py; bit for bit FSDP2's parameters; 1.7B steps 1-5% faster "
        "on an H100); torch keeps FSDP2's own cast and copy per parameter. No effect with several ranks.",
    )
    compile: TrainCompile = F(
        "auto",
        "torch.compile each decoder layer: auto (on CUDA, not on CPU), true or false. The first step pays the "
        "compilation (logged, and perf/compile_total_s per window); later row lengths reuse the graphs.",
    )
    dist_timeout: float = F(1800.0, "Seconds a collective may wait for the other ranks before failing.")
    device: TrainDevice = F("auto", "Training device: auto, cpu or cuda.")
    num_threads: int | None = F(None, "torch threads of the trainer on CPU; None: torch's default.")
    keep_host_memory: bool = F(
        True,
        "Keep freed host memory in the trainer's processes for reuse (glibc's malloc: up to 256 MiB of free heap "
        "kept, allocations under 32 MiB from the heap) instead of faulting fresh pages in for every packed row; "
        "host_memory.py. No effect outside glibc or when MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ are set.",
    )
    profile: ProfileConfig = F(
        help="torch.profiler traces of chosen steps (train/profiler.py).", factory=ProfileConfig
    )


@dataclass
class TeacherConfig:
    servers: dict[str, Any] = F(
        help="Teacher id -> server: a URL (a running vLLM teacher, e.g. http://localhost:8001) or {backend: "
        "embedded, model: NAME_OR_PATH} (a scoring-only embedded server that the run starts). One entry = "
        "plain distillation; several = MOPD, each row routed by its teacher.id_column.",
        factory=dict,
    )
    top_k: int = F(
        8,
        "Candidates per position asked from the teacher (prompt_logprobs); 16-64 for real runs; > 20 needs "
        "the teacher started with --max-logprobs -1.",
    )
    id_column: str = F(
        "teacher_id",
        "Dataset column naming each row's teacher when teacher.servers has several entries (MOPD).",
    )
    timeout: float = F(600.0, "Seconds per scoring request (request_timeout).")
    max_retries: int = F(
        5, "Retries (with backoff) of a scoring request that timed out or got a 5xx before the run stops."
    )
    startup_timeout: float = F(300.0, "Seconds to wait for each teacher to become ready.")
    embedded: EmbeddedServerConfig = F(
        help="Settings of the embedded teachers the run starts (backend: embedded entries).",
        factory=EmbeddedServerConfig,
    )


@dataclass
class DataConfig:
    source: str = F(
        "arithmetic", "Dataset plugin: arithmetic, tiny, hf (hub id or local files), or module:object."
    )
    path: str | None = F(None, "Hub dataset id or local file/directory (source=hf).")
    name: str | None = F(None, "Dataset config name (source=hf).")
    split: str = F("train", "Split to train on.")
    prompt_column: str = F("prompt", "Column holding the prompt (list of chat messages, or a string).")
    num_examples: int | None = F(None, "Generated datasets: how many prompts; others: keep the first N rows.")
    system_prompt: str | None = F(None, "System message prepended to every prompt that has none.")
    shuffle: bool = F(True, "Shuffle prompts each epoch (seeded by trainer.seed and the epoch).")
    seed: int = F(0, "Seed of generated datasets.")
    columns: dict[str, Any] = F(
        help="Constant columns added to every row, e.g. {teacher_id: math} (routes a dataset to a teacher).",
        factory=dict,
    )
    mix: list[dict[str, Any]] = F(
        help="More datasets appended to this one (e.g. MOPD: one per teacher). Each entry holds the data keys "
        "that differ from this group's, e.g. {path: iamtarun/python_code_instructions_18k_alpaca, "
        "prompt_column: instruction, columns: {teacher_id: code}}; only the columns all parts share are kept.",
        factory=list,
    )


@dataclass
class LoggingConfig:
    logging_steps: int = F(1, "Optimizer steps per logging window.")
    sinks: list[SinkName] = F(
        help="Metric sinks: console, jsonl, trackio.", factory=lambda: ["console", "jsonl", "trackio"]
    )
    console: ConsoleMode = F("auto", "Console view: live (rich progress), plain (one line per window), auto.")
    project: str = F("asyncgrpo", "trackio project name.")
    run_name: str | None = F(None, "Run name for trackio; default: the run directory name.")
    log_completions: bool = F(False, "Print a sample of (prompt, completion) pairs every logging window.")
    num_completions_to_print: int | None = F(2, "Completions printed per window when log_completions is on.")
    rename: dict[str, str] = F(
        help="Metric names as logged: {name in the code: name in the sinks}. The distillation group maps the "
        "shared names to the distillation reference's (sample/dropped_stale_count -> sample/dropped_stale_total, "
        "rollout/concurrency -> rollout/inflight, ...); renaming keeps the aggregation (count and total both sum).",
        factory=dict,
    )


@dataclass
class RootConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    algorithm: Algorithm = F(
        "grpo",
        "What the config trains: grpo (asyncgrpo train) or distill (asyncgrpo distill); set by the verb's "
        "primary config and by every recipe, so a recipe runs under its own verb.",
    )
    recipe: str | None = F(None, "Name of the recipe this config was built from (set by the recipe file).")
