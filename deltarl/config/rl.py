"""The RL loop's tables: ``[daemons.rollout]``, ``[daemons.trainer]`` (GRPO) and
``[daemons.scheduler]`` with its ``sampling``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from deltarl.config.base import DaemonTable
from deltarl.config.checks import at_least, endpoints, non_negative, positive
from deltarl.config.reward import RewardClientConfig
from deltarl.transport.blobs import DEFAULT_MAX_FRAME_BYTES, samples_endpoint

ForwardWeights = Literal["published", "master"]
FORWARD_WEIGHTS: tuple[ForwardWeights, ...] = ("published", "master")
"""What the trainer's ``forward_weights`` may be (the config's check and the command lines'
choices)."""


@dataclass(frozen=True)
class RolloutConfig(DaemonTable):
    control: str
    scheduler: str
    """The scheduler's control endpoint (work, samples, heartbeats)."""
    rollout_store: str
    """The apply agent's store: the weights this engine serves."""
    apply_control: str | None = None
    """Accepted for older configurations and unused: the engine's weights are proven against
    the model digest the apply agent commits into the rollout store with each version."""
    store_root: Path | None = None
    model_dir: Path | None = None
    """A Hugging Face model directory (config, tokenizer); None: the embedded default model."""
    instance: str = "rollout"
    """This engine's name at the scheduler (unique per engine)."""
    max_running_groups: int = 8
    heartbeat_s: float = 1.0
    idle_s: float = 0.05
    """How long to wait when there is nothing to generate."""
    store_wait_s: float = 600.0
    """How long to wait for the apply agent's store to hold a first version."""
    engine: dict[str, Any] = field(default_factory=dict)
    """Knobs of ``VllmEngineConfig`` (max_model_len, kv_cache_bytes, dtype, seed, ...). On CPU
    the engine adds what vLLM-CPU needs for seeded requests (``cpu_engine_args``: no chunked
    prefill); ``dtype = "float32"`` is the fast choice on a CPU without AVX-512 bf16."""
    chat: Literal["auto", True, False] = "auto"
    """Render each task prompt as a one-message user turn with the model's chat template:
    "auto" when its tokenizer has one (the embedded tiny model has none: the plain text),
    true (an error without a template), false (the plain text). The sample's
    ``prompt_token_ids`` are the rendered tokens, what the trainer trains on."""
    scheduler_samples: str | None = None
    """The scheduler's samples endpoint, where finished groups are put before their submit;
    None: derived from ``scheduler`` as the scheduler derives it (``samples_endpoint``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "max_running_groups", "heartbeat_s", "idle_s", "store_wait_s")
        if self.chat not in (True, False, "auto"):
            raise ValueError(f'chat must be true, false or "auto", got {self.chat!r}')
        endpoints(self, "scheduler_samples")
        if self.scheduler_samples is None:
            samples_endpoint(self.scheduler)  # derivable now, not a surprise at the first use

    @property
    def samples_endpoint(self) -> str:
        return self.scheduler_samples or samples_endpoint(self.scheduler)


@dataclass(frozen=True)
class RLTrainerConfig(DaemonTable):
    """The ``[daemons.trainer]`` table of the real trainer."""

    control: str
    """The trainer's control endpoint (ROUTER)."""
    scheduler: str
    """The scheduler's control endpoint: TakeBatch, StepDone, Checkpointed go there."""
    published_store: str
    """The weight store the bf16 versions are committed into (the export agent reads it)."""
    model_dir: Path
    """A Hugging Face causal-LM directory: config.json, and weights (without them the model
    is initialised from the config with ``seed``)."""
    checkpoint_dir: Path
    store_root: Path | None = None
    """Directory of the weight stores; None: /dev/shm."""
    scheduler_samples: str | None = None
    """The scheduler's samples endpoint, where a batch's samples are fetched by reference;
    None: derived from ``scheduler`` as the scheduler derives it (``samples_endpoint``)."""
    checkpoint_every: int = 10
    """Steps between checkpoints (and at ``max_steps`` and on a clean shutdown)."""
    keep_checkpoints: int = 3
    lr: float = 5e-3
    """AdamW's learning rate. The default suits the tiny random-init models of ``deltarl up``:
    measured on a 90k-parameter Qwen2 rewarded for tokens of one eighth of its vocabulary,
    20 steps of 8 groups x 8 samples took the rewarded mass from 0.12 to 0.9 at 5e-3 (0.35 at
    2e-3, 0.2 at 1e-3; 1e-2 saturates at 1.0 by step 15, a collapse risk on a real task);
    tests/trainer/test_grpo.py holds it to that. A pretrained model wants 1e-6 .. 1e-5."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay; 0: RL post-training should not pull the pretrained
    weights towards zero, only towards more reward."""
    clip_eps: float = 0.2
    objective: Literal["clipped", "decoupled"] = "decoupled"
    """The policy loss (deltarl/trainer/grpo.py). "decoupled": the clip around the policy the
    step starts from, and the staleness corrected by importance weights truncated at
    ``behaviour_weight_cap``. "clipped": PPO's clip of the ratio to the behaviour policy,
    which zeroes the gradient of stale tokens the newer policies already moved past the band.
    The two are the same on fresh samples. Measured with the tiny model (40 steps, five
    seed/lag-rule pairs, ``deltarl bench schedule --convergence``): over the last quarter of
    the steps, at lag bound 1 the clipped objective reached 0.49x the mean reward of
    ``sync``, the decoupled one 0.87x (at bound 3: 0.28x against 0.98x)."""
    behaviour_weight_cap: float = 2.0
    """With ``objective = "decoupled"``: the largest importance weight a token may carry."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the initial model; > 0 keeps a frozen copy of it."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0: none (the norm is still reported)."""
    groups_per_step: int = 4
    max_steps: int = 0
    """Stop training after this step (keep serving control); 0: never."""
    seed: int = 0
    micro_batch: int = 8
    """Samples per forward/backward pass."""
    pad_token_id: int = 0
    """Fills the padding (it is masked, so any id in the vocabulary does)."""
    wait_s: float = 0.5
    """How long to wait when the scheduler has no batch and names no wait, or is not there."""
    request_timeout_s: float = 30.0
    threads: int = 0
    """Torch intra-op threads; 0: torch's default. Bit-exact resume needs the same number."""
    ranks: int = 1
    """Data-parallel ranks (deltarl/trainer/ranks.py): this daemon is rank 0 and starts the
    others as its own processes, ``threads`` torch threads each. Bit-exact resume needs the
    same number."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model trains: "auto" is a GPU where torch sees one (rank r on GPU r modulo
    their number, the ranks in one NCCL group), else the CPU (one gloo group)."""
    compute_dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """What the forward and backward passes compute in. The master weights, gradients and
    AdamW stay float32 whatever it is; "bfloat16" runs the matmuls under torch.autocast, as
    RL trainers on GPUs do; "auto" picks bfloat16 where the device has bf16 arithmetic (a GPU
    that supports it, a CPU with AVX512-BF16 or AMX) and float32 elsewhere, where emulated
    bf16 is slower than float32. Measured on a 2-core AVX512-BF16 CPU: a SmolLM2-135M
    forward and backward of 4 x 110 tokens took 1.8 s in bf16 against 3.1 s in float32."""
    forward_weights: ForwardWeights = "published"
    """The weights a training pass runs at. "published": the bf16 rounding of the master
    weights, which is what the publisher writes and the engines sample with; the gradient
    there is applied to the float32 master weights (as mixed-precision trainers keep a bf16
    copy for their passes). "master": the float32 master weights themselves, which at RL
    learning rates are a policy no engine serves: measured on SmolLM2-135M at lr 3e-5, after
    one step their log-probabilities of the engine's next samples were 0.22 nats from the
    engine's on average (1.4-2.2% of tokens capped by the decoupled objective under a
    synchronous loop), against 7e-6 at the published weights (deltarl/trainer/grpo.py).
    Which learns more is not settled: on SmolLM2 a synchronous loop at the master weights
    learned as much or a little more over 15 steps (1.13-1.34x the reward, 2 seeds), on the
    tiny model "published" 1.9x in `deltarl up` (2 seeds) but less asynchronously under the
    partial lag rule (4 seeds, within noise; README)."""
    rank_timeout_s: float = 600.0
    """How long a collective may wait for a rank that does not answer (one that died is seen
    at once): then the step fails and the daemon exits for its supervisor to restart it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("checkpoint_every", "keep_checkpoints", "groups_per_step", "micro_batch"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be at least 1, got {getattr(self, key)}")
        positive(
            self, "lr", "clip_eps", "behaviour_weight_cap", "wait_s", "request_timeout_s",
            "rank_timeout_s",
        )  # fmt: skip
        if self.objective not in ("clipped", "decoupled"):
            raise ValueError(f'objective must be "clipped" or "decoupled", got {self.objective!r}')
        if self.ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {self.ranks}")
        if self.compute_dtype not in ("float32", "bfloat16", "auto"):
            raise ValueError(
                f'compute_dtype must be "float32", "bfloat16" or "auto", got {self.compute_dtype!r}'
            )
        if self.forward_weights not in FORWARD_WEIGHTS:
            raise ValueError(
                f'forward_weights must be "published" or "master", got {self.forward_weights!r}'
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f'device must be "auto", "cpu" or "cuda", got {self.device!r}')
        non_negative(self, "weight_decay", "kl_coef", "max_grad_norm", "max_steps", "threads")
        endpoints(self, "scheduler_samples")
        if self.scheduler_samples is None:
            samples_endpoint(self.scheduler)  # derivable now, not a surprise at the first use

    @property
    def samples_endpoint(self) -> str:
        return self.scheduler_samples or samples_endpoint(self.scheduler)


LagAction = Literal["throttle", "drop", "sync"]
LagRule = Literal["oldest_token", "partial"]


@dataclass(frozen=True)
class Sampling:
    """What every group is generated with (``Work.groups[i]["sampling"]``, plus a seed).

    ``temperature``: any positive finite value (a lower one draws closer to the greedy answer,
    so more GRPO groups hold both right and wrong answers). The GRPO importance ratio divides
    the trainer's log-probability of each token by the engine's, and the two must be of the
    same distribution: vLLM records "processed" log-probabilities, after temperature scaling,
    and the trainer computes ``log_softmax(logits / temperature)`` with the temperature each
    ``Batch`` carries (the scheduler's, from this table).

    ``top_p`` must be 1.0: anything else is refused (a configuration error, so the daemon
    exits 78). Top-p truncation renormalises over a set the trainer does not reconstruct, so
    the ratio would be off by a per-token factor nobody sees, and training would silently go
    wrong. Temperature 0 (greedy) is refused for the same reason: its log-probabilities are
    not those of any distribution the trainer can compute.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"sampling: temperature must be positive and finite, got {self.temperature}: "
                "greedy decoding has no log-probabilities for the GRPO importance ratio"
            )
        if self.top_p != 1.0:
            raise ValueError(
                f"sampling: top_p must be 1.0, got {self.top_p}: the engine records "
                "log-probabilities after top-p truncation, which the trainer does not "
                "reconstruct, so any other value silently breaks the GRPO importance ratio"
            )
        if self.max_tokens < 1:
            raise ValueError(f"sampling: max_tokens >= 1 is required, got {self.max_tokens}")


@dataclass(frozen=True)
class SchedulerConfig(DaemonTable):
    control: str
    """The scheduler's control endpoint: rollout daemons, the trainer and ``ctl`` talk to it."""
    db: Path
    """The sqlite store (deltarl.scheduler.store): cursor, groups, counters, run metadata."""
    samples: str | None = None
    """The samples endpoint (deltarl.transport.blobs), where rollout daemons put and the
    trainer gets encoded groups; None: derived from ``control`` (``samples_endpoint``)."""
    samples_grace_s: float = 600.0
    """A blob put on the samples endpoint that no submit has referred to for this long is
    removed (its submit never came, or was refused)."""
    max_sample_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """The largest encoded group the samples endpoint takes; bigger is refused (too_large)."""
    task: str = "default"
    """The task by name (deltarl.rl.task.tasks()): prompts and reward."""
    policy: str = "fifo"
    """The dispatch policy by name (deltarl.scheduler.policy.POLICIES): fifo, least_requests,
    sync (the synchronous baseline) or deltarl (predicted wait, longest first)."""
    lookahead: int = 64
    """How many fresh prompts past those that may be issued now the ``deltarl`` policy
    chooses among (longest predicted first). Wider starts long prompts earlier: less drain at
    a dataset's end and fewer stale long groups, but each step's prompts drift further from
    the dataset's (or the plan's) order, and steps of mostly short completions appear
    (measured: README, "Length-aware scheduling"). Other policies ignore it."""
    plan: Path | None = None
    """An offline plan (``deltarl plan``): prompts issued in its order, predictions from it,
    corrected online (deltarl/scheduler/plan_view.py). None: dataset order, no predictions."""
    group_size: int = 8
    """Samples per prompt (GRPO's group)."""
    groups_per_step: int = 8
    """Groups per optimizer step; a TakeBatch asking for another number is refused."""
    pool_capacity: int = 64
    """Groups the pool holds, counting the ones issued and not yet submitted (their slots are
    reserved at issue, so a submission never finds the pool full)."""
    max_policy_lag_steps: int = 2
    """A hard bound: no batch holds a group whose oldest token is more versions behind the
    trainer than this, measured when the batch is shipped."""
    on_lag_exceeded: LagAction = "throttle"
    """What keeps the lag in bound besides dropping stale groups at ship time (service docs)."""
    lag_rule: LagRule = "oldest_token"
    """Which token of a group its lag is measured from (deltarl/scheduler/token_lag.py):
    ``oldest_token`` bounds every trained token, and a group that outlives the bound is wasted;
    ``partial`` lets a group that lives through refits go on under the new weights (a partial
    rollout, each token's importance ratio against the version that sampled it) and bounds its
    newest token: nothing in flight is wasted, and the age of its old tokens is recorded."""
    max_token_lag_steps: int | None = None
    """Under ``lag_rule = "partial"``: the most versions a group's oldest token may be behind
    the trainer when it ships (None: no cap). A group over it is dropped at ship time, and
    aborted while still generating, as every group over the bound is under ``oldest_token``:
    the cap on how stale a trained token may get (measured: without one, a heavy-tailed
    workload trains 40% of its tokens more than the bound behind). At least
    ``max_policy_lag_steps``; ignored under ``oldest_token``, where that bound is the cap."""
    heartbeat_timeout_s: float = 15.0
    """An instance silent this long is removed and its groups are queued again."""
    not_held_grace_s: float = 5.0
    """A heartbeat that reports what its instance holds (``Heartbeat.reports_held``) requeues
    the groups issued to that instance and session that it does not hold, if they were issued
    more than this long ago (younger ones: their Work reply may still be on its way)."""
    lease_s: float = 300.0
    """An issued group not submitted this long after its issue is queued again (heartbeats
    do not renew it: see the service's docstring). Durable across scheduler restarts."""
    reward_timeout_s: float = 10.0
    reward_retries: int = 2
    reward_workers: int = 8
    reward: RewardClientConfig | None = None
    """``[daemons.scheduler.reward]``: score on the reward daemon at ``endpoint`` (timeout,
    retries, concurrency, rate limit, circuit breaker: ``deltarl.config.reward``); None: in
    this process with the three ``reward_*`` keys above."""
    max_reward_failures: int = 3
    """A prompt whose group failed this often is abandoned (counted ``abandoned_prompts``);
    0: never. A failure: its reward could not be had (``reward_*``), or its samples were
    malformed (``bad_samples``), so a prompt that can never be trained cannot stall the run."""
    sampling: Sampling = field(default_factory=Sampling)
    """``[daemons.scheduler.sampling]``: temperature (positive), top_p (1.0 only), max_tokens."""
    dataset_size: int = 0
    """Prompts in the dataset; 0: infinite."""
    seed: int = 0
    """The dataset's and the sampling seeds' root."""
    tick_s: float = 0.5
    """How often heartbeats and leases are checked."""
    wait_s: float = 0.2
    """The back-off suggested in an empty Work or Batch."""
    eval_every: int = 0
    """Evaluate the policy on the task's held-out split every this many steps, and once before
    training (step 0), greedily, one sample per prompt (deltarl/scheduler/evaluation.py); the
    accuracy goes to the run history. 0: never; a task without a held-out split: never."""
    eval_prompts: int = 0
    """Evaluate on the first this many prompts of the held-out split; 0: all of it
    (``task.eval_size``). A CPU engine decodes a 64-prompt round in tens of seconds."""
    eval_share: float = 0.5
    """The share of the groups an instance asks for that an open eval round takes first
    (0 < share <= 1; training work fills the rest). 1: the round goes out whole at once and
    is measured on one version, at the cost of a short pause in training generation."""
    straggler_ratio: float = 0.0
    """Bench an instance whose decode rate per running group stays below this share of its
    busy peers' median for ``straggler_window_s`` (deltarl/scheduler/stragglers.py): its work
    is requeued and it gets none for ``straggler_cooldown_s``. 0: never."""
    straggler_window_s: float = 30.0
    straggler_cooldown_s: float = 60.0
    keep_steps: int = 1000
    """Steps whose records the store keeps: older checkpointed steps lose their ``steps`` row
    (the run history) and their trained prompt rows (deltarl/scheduler/retention.py). Steps
    after the last checkpoint are kept whatever their number, for exact replay."""

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self, 1, "keep_steps")
        positive(self, "group_size", "groups_per_step", "pool_capacity", "reward_workers")
        positive(self, "heartbeat_timeout_s", "lease_s", "reward_timeout_s", "tick_s", "wait_s")
        positive(self, "samples_grace_s", "max_sample_bytes")
        positive(self, "straggler_window_s", "straggler_cooldown_s")
        if not 0.0 <= self.straggler_ratio < 1.0:
            raise ValueError(f"straggler_ratio must be in [0, 1), got {self.straggler_ratio}")
        endpoints(self, "samples")
        if self.samples is None:
            samples_endpoint(self.control)  # derivable now, not a surprise at bind time
        non_negative(self, "max_policy_lag_steps", "reward_retries", "max_reward_failures")
        non_negative(self, "lookahead")
        cap = self.max_token_lag_steps
        if cap is not None and cap < self.max_policy_lag_steps:
            raise ValueError(
                f"max_token_lag_steps ({cap}) must be at least max_policy_lag_steps "
                f"({self.max_policy_lag_steps}): the cap is on the oldest token, the bound on "
                "the newest"
            )
        non_negative(self, "dataset_size", "not_held_grace_s", "eval_every", "eval_prompts")
        if not 0 < self.eval_share <= 1:
            raise ValueError(f"eval_share must be in (0, 1], got {self.eval_share}")
        if self.pool_capacity < self.groups_per_step:
            raise ValueError(
                f"pool_capacity ({self.pool_capacity}) must hold at least groups_per_step "
                f"({self.groups_per_step}), or no step could ever be filled"
            )

    @property
    def samples_endpoint(self) -> str:
        """Where the samples socket is bound: ``samples``, or the one derived from ``control``."""
        return self.samples or samples_endpoint(self.control)

    @property
    def sampling_params(self) -> Sampling:
        return self.sampling

    def as_record(self) -> dict[str, Any]:
        """The configuration as plain JSON values (the run metadata)."""
        record = dataclasses.asdict(self)
        record["db"] = str(self.db)
        record["plan"] = None if self.plan is None else str(self.plan)
        return record
