"""GRPO: advantages, batch building, the clipped loss and its gradients, and that it learns."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from deltarl.config.rl import RLTrainerConfig
from deltarl.rl.samples import Group, Sample
from deltarl.trainer.grpo import (
    ADV_EPS,
    BatchError,
    GRPOBatch,
    GRPOConfig,
    ScoredGroup,
    build_batch,
    group_advantages,
    grpo_loss,
    published_weights,
    token_logprobs,
    train_step,
)
from deltarl.trainer.service import computes_bf16, grpo_config
from tests.trainer.tiny import VOCAB, sample_groups, tiny_model


def _sample(
    prompt: list[int], completion: list[int], reward: float, lp: float = -1.0
) -> tuple[Sample, float]:
    return Sample(prompt, completion, [lp] * len(completion), [0] * len(completion)), reward


def _group(gid: str, *samples: tuple[Sample, float]) -> ScoredGroup:
    return ScoredGroup(Group(gid, 0, tuple(s for s, _ in samples)), tuple(r for _, r in samples))


# -- advantages -------------------------------------------------------------------------------


def test_advantages_are_group_normalised() -> None:
    rewards = [1.0, 0.0, 0.5, 0.25]
    adv = group_advantages(rewards).double()
    r = torch.tensor(rewards, dtype=torch.float64)
    expected = (r - r.mean()) / (r.std(correction=0) + ADV_EPS)
    assert torch.allclose(adv, expected, atol=1e-6)
    assert abs(adv.mean().item()) < 1e-6
    assert adv.std(correction=0).item() == pytest.approx(1.0, abs=1e-4)
    assert adv.argmax().item() == 0
    assert adv.argmin().item() == 1


def test_equal_rewards_and_singletons_give_zero_advantage() -> None:
    # 0.1 * 3 / 3 is not exactly 0.1 in floating point: the std is 1e-17, not 0.
    assert torch.equal(group_advantages([0.1, 0.1, 0.1]), torch.zeros(3))
    assert torch.equal(group_advantages([7.0]), torch.zeros(1))
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, math.nan])


# -- the batch --------------------------------------------------------------------------------


def test_batch_aligns_completion_tokens_with_their_predicting_positions() -> None:
    groups = [
        _group("a", _sample([5, 6, 7], [8, 9], 1.0, -0.5), _sample([5, 6, 7], [10], 0.0, -2.0)),
        _group("b", _sample([3], [4, 4, 4, 4], 2.0, -3.0)),
    ]
    b = build_batch(groups, pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 10, 0], [3, 4, 4, 4, 4]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # Target j is input token j + 1: completion tokens are targets from len(prompt) - 1 on.
    assert b.loss_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0], [1, 1, 1, 1]]
    assert b.behaviour_logprobs.tolist() == [[0, 0, -0.5, -0.5], [0, 0, -2, 0], [-3] * 4]
    assert b.tokens == 7
    assert b.advantages[0] > 0 > b.advantages[1]
    assert b.advantages[2] == 0  # a group of one carries no relative signal
    assert b.rewards.tolist() == [1.0, 0.0, 2.0]
    # A micro-batch is trimmed to its own longest row.
    tail = b.rows(1, 2)
    assert tail.input_ids.tolist() == [[5, 6, 7, 10]]
    assert tail.loss_mask.tolist() == [[0, 0, 1]]
    assert sum(m.tokens for m in b.micro_batches(2)) == b.tokens


def test_malformed_batches_are_named() -> None:
    """The samples themselves were validated when their bytes were decoded (tests/rl/
    test_samples.py: mismatched lengths, empty prompts...); a batch adds one finite reward per
    sample, and needs a sample."""
    two = _group("g7", _sample([1], [2], 0.0), _sample([1, 2], [3, 4], 1.0))
    with pytest.raises(BatchError, match=r"group 'g7': 2 samples but 1 rewards"):
        build_batch([ScoredGroup(two.group, two.rewards[:1])])
    with pytest.raises(BatchError, match=r"group 'g7': group rewards must be finite"):
        build_batch([ScoredGroup(two.group, (1.0, math.nan))])
    with pytest.raises(BatchError, match="at least one sample"):
        build_batch([_group("g")])


# -- the loss ---------------------------------------------------------------------------------


def test_clipped_tokens_get_exactly_zero_gradient() -> None:
    eps = 0.2
    # ratio: 1.5 and 0.5 with a positive advantage, then with a negative one, then 1.0.
    ratios = torch.tensor([[1.5, 0.5], [1.5, 0.5], [1.0, 1.0]], dtype=torch.float64)
    behaviour = torch.full((3, 2), -2.0, dtype=torch.float64)
    logp = (behaviour + ratios.log()).clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(3, 2, dtype=torch.float64)
    loss, sums = grpo_loss(logp, behaviour, adv, mask, clip_eps=eps, normaliser=6.0)
    loss.backward()
    grad = logp.grad
    assert grad is not None
    # A > 0 clips above 1 + eps, A < 0 below 1 - eps: there the gradient is exactly zero.
    assert grad[0, 0].item() == 0.0
    assert grad[1, 1].item() == 0.0
    # Elsewhere d(-ratio * A)/dlogp = -ratio * A / T.
    assert grad[0, 1].item() == pytest.approx(-0.5 / 6)
    assert grad[1, 0].item() == pytest.approx(1.5 / 6)
    assert grad[2].tolist() == pytest.approx([-1 / 6, -1 / 6])
    assert sums.clipped == 2
    assert sums.tokens == 6
    # The clipped tokens contribute their clipped value to the loss.
    expected = -(1.2 + 0.5 - 1.5 - 0.8 + 1.0 + 1.0) / 6
    assert loss.item() == pytest.approx(expected)


def test_the_decoupled_objective_keeps_stale_tokens_weighted_and_truncated() -> None:
    """The tokens the clipped objective zeroes (above) get a gradient weighted by
    pi / pi_behaviour, at most the cap; the cap counts the tokens it truncated."""
    ratios = torch.tensor([[1.5, 0.5], [1.5, 0.5], [1.0, 3.0]], dtype=torch.float64)
    behaviour = torch.full((3, 2), -2.0, dtype=torch.float64)
    logp = (behaviour + ratios.log()).clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(3, 2, dtype=torch.float64)
    loss, sums = grpo_loss(
        logp, behaviour, adv, mask, clip_eps=0.2, normaliser=6.0, behaviour_weight_cap=2.0
    )
    loss.backward()
    assert logp.grad is not None
    # d(-w * exp(logp - sg(logp)) * A)/dlogp = -w * A / T, w = min(ratio, 2): never zero.
    weights = torch.tensor([[1.5, 0.5], [1.5, 0.5], [1.0, 2.0]], dtype=torch.float64)
    expected = -weights * adv.unsqueeze(-1) / 6
    assert torch.allclose(logp.grad, expected)
    assert sums.clipped == 0
    assert sums.capped == 1
    assert loss.item() == pytest.approx(-(weights * adv.unsqueeze(-1)).sum().item() / 6)


def test_on_fresh_samples_both_objectives_are_one() -> None:
    """Where the engine's log-probabilities are the policy's own (sync), the decoupled
    objective's loss and gradient are the clipped one's."""
    torch.manual_seed(3)
    behaviour = -torch.rand(4, 5, dtype=torch.float64) * 3
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0], dtype=torch.float64)
    mask = (torch.rand(4, 5) > 0.2).double()
    grads, losses = [], []
    for cap in (0.0, 2.0):
        logp = behaviour.clone().requires_grad_(True)
        loss, _ = grpo_loss(
            logp, behaviour, adv, mask, clip_eps=0.2, normaliser=20.0, behaviour_weight_cap=cap
        )
        loss.backward()
        assert logp.grad is not None
        grads.append(logp.grad)
        losses.append(loss.item())
    assert torch.allclose(grads[0], grads[1])
    assert losses[0] == pytest.approx(losses[1])
    with pytest.raises(ValueError, match="behaviour_weight_cap"):
        grpo_loss(behaviour, behaviour, adv, mask, clip_eps=0.2, normaliser=1.0,
                  behaviour_weight_cap=-1.0)  # fmt: skip
    where = {
        "control": "tcp://127.0.0.1:1",
        "scheduler": "tcp://127.0.0.1:2",
        "published_store": "x",
        "model_dir": Path("m"),
        "checkpoint_dir": Path("c"),
    }
    assert grpo_config(RLTrainerConfig(**where), 1.0).behaviour_weight_cap == 2.0  # default
    clipped = RLTrainerConfig(**where, objective="clipped", behaviour_weight_cap=3.0)
    assert grpo_config(clipped, 1.0).behaviour_weight_cap == 0.0
    decoupled = RLTrainerConfig(**where, behaviour_weight_cap=3.0)
    assert grpo_config(decoupled, 1.0).behaviour_weight_cap == 3.0
    assert grpo_config(decoupled, 1.0).published_forward is True  # the default
    at_master = RLTrainerConfig(**where, forward_weights="master")
    assert grpo_config(at_master, 1.0).published_forward is False
    with pytest.raises(ValueError, match="forward_weights"):
        RLTrainerConfig(**where, forward_weights="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="objective"):
        RLTrainerConfig(
            control="tcp://127.0.0.1:1",
            scheduler="tcp://127.0.0.1:2",
            published_store="x",
            model_dir=Path("m"),
            checkpoint_dir=Path("c"),
            objective="other",  # type: ignore[arg-type]
        )


def test_padding_never_leaks_into_the_loss() -> None:
    logp = torch.tensor([[-1.0, 50.0]], requires_grad=True)  # garbage where masked
    behaviour = torch.tensor([[-1.0, -80.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, sums = grpo_loss(logp, behaviour, torch.tensor([1.0]), mask, clip_eps=0.2, normaliser=1)
    loss.backward()
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(-1.0)
    assert logp.grad is not None
    assert logp.grad[0, 1].item() == 0.0
    assert sums.tokens == 1
    assert sums.kl_behaviour == 0.0


def test_k3_kl_term() -> None:
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    zero_adv = torch.zeros(1, dtype=torch.float64)
    loss, sums = grpo_loss(
        logp,
        logp.detach(),
        zero_adv,
        mask,
        clip_eps=0.2,
        normaliser=2,
        ref_logprobs=ref,
        kl_coef=0.5,
    )
    d = -0.5
    k3 = math.exp(d) - d - 1
    assert sums.kl == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.5 * k3 / 2)
    loss.backward()
    assert logp.grad is not None
    # d k3 / d logp = 1 - exp(ref - logp): pulls logp down towards the reference.
    assert logp.grad[0, 0].item() == pytest.approx(0.5 * (1 - math.exp(d)) / 2)
    assert logp.grad[0, 1].item() == 0.0
    # Without a coefficient the KL is measured but does not enter the loss.
    loss0, sums0 = grpo_loss(
        logp,
        logp.detach(),
        zero_adv,
        mask,
        clip_eps=0.2,
        normaliser=2,
        ref_logprobs=ref,
        kl_coef=0.0,
    )
    assert loss0.item() == 0.0
    assert sums0.kl == pytest.approx(k3)


def test_loss_is_token_mean_and_micro_batching_does_not_change_the_gradient() -> None:
    torch.manual_seed(0)
    model = tiny_model(0)
    groups = [
        _group("a", _sample([1, 2], [3, 4, 5, 6, 7, 8], 1.0), _sample([1, 2], [9], 0.0)),
        _group("b", _sample([4, 4, 4], [5, 5], 0.0), _sample([4, 4, 4], [6, 6, 6], 3.0)),
    ]
    batch = build_batch(groups)
    with torch.no_grad():
        current = token_logprobs(model, batch.input_ids, batch.attention_mask)
    # On-policy (behaviour == current): ratio 1, loss = -sum_i A_i * n_i / T.
    on_policy = build_batch(groups)
    on_policy.behaviour_logprobs.copy_(current * batch.loss_mask)
    n_tokens = batch.loss_mask.sum(dim=1)
    expected = -(batch.advantages * n_tokens).sum().item() / batch.tokens

    grads = []
    for micro in (1, 3, 8):
        m = tiny_model(0)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)  # only the gradient is of interest
        stats = train_step(m, opt, on_policy, GRPOConfig(micro_batch=micro, max_grad_norm=0))
        assert stats.loss == pytest.approx(expected, abs=1e-5)
        assert stats.tokens == 12
        assert stats.samples == 4
        assert stats.clip_frac == 0.0
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
    assert grads[0].abs().sum() > 0
    for g in grads[1:]:
        assert torch.allclose(g, grads[0], rtol=1e-4, atol=1e-7)


def test_micro_batches_are_length_sorted_and_the_padding_ratio_says_what_they_ran() -> None:
    """Sequences of 8, 3, 8 and 3 tokens (22 real). In the order given, micro-batches of 2 run
    2 x 8 twice (32 positions); sorted by length they run 2 x 3 and 2 x 8 (22: no padding).
    One micro-batch of 4 runs 4 x 8 either way. Sorting changes no figure but the padding."""
    groups = [
        _group("a", _sample([1, 2], [3, 4, 5, 6, 7, 8], 1.0), _sample([1, 2], [9], 0.0)),
        _group("b", _sample([4, 4], [5, 5, 5, 5, 5, 5], 0.0), _sample([4, 4], [6], 3.0)),
    ]
    batch = build_batch(groups)
    assert batch.attention_mask.sum(dim=1).tolist() == [8, 3, 8, 3]
    assert batch.by_length().attention_mask.sum(dim=1).tolist() == [3, 3, 8, 8]
    stats = {}
    for micro in (2, 4):
        m = tiny_model(0)
        config = GRPOConfig(micro_batch=micro, max_grad_norm=0)
        stats[micro] = train_step(m, torch.optim.SGD(m.parameters(), lr=0.0), batch, config)
    assert stats[2].padding_ratio == pytest.approx(0.0)
    assert stats[4].padding_ratio == pytest.approx(1 - 22 / 32)
    assert stats[2].loss == pytest.approx(stats[4].loss, abs=1e-6)
    assert stats[2].tokens == stats[4].tokens == 14


@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.5])
def test_log_probabilities_are_taken_at_the_batch_temperature(temperature: float) -> None:
    model = tiny_model(0)
    groups = [_group("a", _sample([1, 2], [3, 4, 5], 1.0), _sample([1, 2], [6, 7], 0.0))]
    batch = build_batch(groups)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits[:, :-1].float()
        want = torch.log_softmax(logits / temperature, -1)
        want = want.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        got = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature)
        plain = token_logprobs(model, batch.input_ids, batch.attention_mask)
    on = batch.loss_mask > 0
    assert torch.allclose(got[on], want[on], atol=1e-5)
    assert (got[on] - plain[on]).abs().max() > 1e-3  # the temperature is not ignored
    # Behaviour log-probs drawn at this temperature are on-policy for a step at it (ratio 1,
    # nothing clipped, no KL to the behaviour policy), and off-policy for a step at 1.0.
    batch.behaviour_logprobs.copy_(got * batch.loss_mask)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cfg = GRPOConfig(temperature=temperature, max_grad_norm=0)
    at_t = train_step(model, opt, batch, cfg)
    assert at_t.kl_behaviour == pytest.approx(0.0, abs=1e-6)
    assert at_t.clip_frac == 0.0
    at_one = train_step(model, opt, batch, GRPOConfig(max_grad_norm=0))
    assert at_one.kl_behaviour > 1e-4


class _NoKeepArgument(torch.nn.Module):
    """A causal LM whose forward has no ``logits_to_keep``: the head then runs everywhere."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_cache: bool
    ) -> object:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


@pytest.mark.parametrize("wrapped", [False, True])
def test_log_probabilities_from_the_first_completion_column_match_the_full_ones(
    wrapped: bool,
) -> None:
    """The head runs only from ``first`` on (through ``logits_to_keep`` where the model takes
    it, by slicing where it does not): the columns from ``first`` equal the full computation's,
    the ones before are 0, and train_step gives the loss it gave on the full columns."""
    inner = tiny_model(0)
    model = _NoKeepArgument(inner) if wrapped else inner
    groups = [
        _group("a", _sample([1, 2, 3, 4], [5, 6, 7], 1.0), _sample([9, 8, 7, 6, 5], [4], 0.0)),
    ]
    batch = build_batch(groups)
    first = int(batch.loss_mask.any(dim=0).nonzero()[0])
    assert first == 3  # the shorter prompt's last position predicts its first completion token
    with torch.no_grad():
        full = token_logprobs(model, batch.input_ids, batch.attention_mask, 0.7)
        part = token_logprobs(model, batch.input_ids, batch.attention_mask, 0.7, first)
    assert part.shape == full.shape
    assert torch.equal(part[:, :first], torch.zeros(2, first))
    assert torch.allclose(part[:, first:], full[:, first:], atol=1e-5)
    assert getattr(model, "_deltarl_logits_to_keep", None) is (not wrapped)
    on = batch.loss_mask > 0
    batch.behaviour_logprobs.copy_(full * batch.loss_mask)
    stats = train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.0), batch, GRPOConfig(temperature=0.7)
    )
    expected = -(batch.advantages * batch.loss_mask.sum(dim=1)).sum().item() / int(on.sum())
    assert stats.loss == pytest.approx(expected, abs=1e-5)
    assert stats.kl_behaviour == pytest.approx(0.0, abs=1e-6)


def test_a_bf16_step_keeps_float32_weights_and_close_log_probabilities() -> None:
    """compute_dtype bfloat16: the passes run under autocast, the parameters, gradients and
    optimizer stay float32, and the step's figures stay close to the float32 step's."""
    groups = [
        _group("a", _sample([1, 2], [3, 4, 5, 6], 1.0), _sample([1, 2], [9, 9], 0.0)),
        _group("b", _sample([4, 4, 4], [5, 5], 0.0), _sample([4, 4, 4], [6, 6, 6], 3.0)),
    ]
    stats = {}
    models = {}
    for bf16 in (False, True):
        m = tiny_model(0)
        batch = build_batch(groups)
        with torch.no_grad():
            batch.behaviour_logprobs.copy_(
                token_logprobs(m, batch.input_ids, batch.attention_mask) * batch.loss_mask
            )
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        stats[bf16] = train_step(m, opt, batch, GRPOConfig(bf16=bf16))
        models[bf16] = m
    assert all(p.dtype == torch.float32 for p in models[True].parameters())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in models[True].parameters())
    # bf16 rounds the log-probabilities (the ratio is no longer exactly 1), not the step.
    assert 0.0 < stats[True].kl_behaviour < 1e-3
    assert stats[True].loss == pytest.approx(stats[False].loss, abs=2e-2)
    assert stats[True].grad_norm == pytest.approx(stats[False].grad_norm, rel=0.1)
    moved = [
        (a - b).abs().max().item()
        for a, b in zip(models[True].parameters(), tiny_model(0).parameters(), strict=True)
    ]
    assert max(moved) > 0


def _off_grid(seed: int) -> torch.nn.Module:
    """A tiny model whose float32 master weights are off bf16's grid, as they are after any
    AdamW step at an RL learning rate (most of the update below bf16's resolution)."""
    model = tiny_model(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 2e-3 * torch.randn(p.shape, generator=gen))
    assert any(not torch.equal(p, p.to(torch.bfloat16).float()) for p in model.parameters())
    return model


def _served(master: torch.nn.Module) -> torch.nn.Module:
    """The model the engines serve after the publisher wrote ``master``: every weight rounded
    to bf16, computed in float32."""
    served = tiny_model(0)
    state = master.state_dict()
    served.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in state.items()})
    return served


def _behaviour_from(model: torch.nn.Module, groups: list[ScoredGroup]) -> GRPOBatch:
    batch = build_batch(groups)
    with torch.no_grad():
        batch.behaviour_logprobs.copy_(
            token_logprobs(model, batch.input_ids, batch.attention_mask, 0.7) * batch.loss_mask
        )
    return batch


def test_published_forward_trains_the_policy_the_engines_sample() -> None:
    """forward_weights "published": under a synchronous loop the behaviour log-probabilities
    (the engine's, at the published bf16 weights) are exactly the trainer's, and the gradient
    is the served model's, applied to the master weights, which keep their float32 values.
    At the master weights the same samples look off-policy."""
    master = _off_grid(3)
    groups = [
        _group("a", _sample([1, 2], [3, 4, 5, 6], 1.0), _sample([1, 2], [9, 9], 0.0)),
        _group("b", _sample([4, 4, 4], [5, 5], 0.0), _sample([4, 4, 4], [6, 6, 6], 3.0)),
    ]
    served = _served(master)
    batch = _behaviour_from(served, groups)
    before = [p.detach().clone() for p in master.parameters()]
    cfg = GRPOConfig(temperature=0.7, behaviour_weight_cap=2.0, published_forward=True)
    stats = train_step(master, torch.optim.SGD(master.parameters(), lr=0.0), batch, cfg)
    assert stats.kl_behaviour == 0.0  # bit-identical log-probabilities, not merely close
    assert stats.cap_frac == 0.0
    # The master weights come back bit for bit (lr 0: the step itself moves nothing) ...
    assert all(torch.equal(a, b) for a, b in zip(master.parameters(), before, strict=True))
    # ... carrying the served model's gradient.
    reference = train_step(
        served,
        torch.optim.SGD(served.parameters(), lr=0.0),
        batch,
        dataclasses.replace(cfg, published_forward=False),
    )
    assert stats.loss == reference.loss
    for a, b in zip(master.parameters(), served.parameters(), strict=True):
        assert a.grad is not None
        assert b.grad is not None
        assert torch.equal(a.grad, b.grad)
    # At the master weights the trainer sees another policy than the one that sampled.
    at_master = tiny_model(0)
    at_master.load_state_dict(master.state_dict())
    off = train_step(
        at_master,
        torch.optim.SGD(at_master.parameters(), lr=0.0),
        batch,
        dataclasses.replace(cfg, published_forward=False),
    )
    assert off.kl_behaviour > 0.0
    grads = zip(at_master.parameters(), served.parameters(), strict=True)
    assert any(not torch.equal(a.grad, b.grad) for a, b in grads)  # type: ignore[arg-type]


def test_published_weights_give_the_master_back_when_a_pass_fails() -> None:
    """A pass that raises inside (a token outside the vocabulary) must not leave the master
    weights rounded: a rounded master would lose the sub-resolution part of every update."""
    master = _off_grid(5)
    before = [p.detach().clone() for p in master.parameters()]
    bad = [_group("x", _sample([1, 2], [VOCAB + 7, 4], 1.0), _sample([1, 2], [3, 3], 0.0))]
    cfg = GRPOConfig(published_forward=True)
    with pytest.raises(IndexError):
        train_step(master, torch.optim.SGD(master.parameters(), lr=0.0), build_batch(bad), cfg)
    assert all(torch.equal(a, b) for a, b in zip(master.parameters(), before, strict=True))
    params = list(master.parameters())
    with published_weights(params):
        assert all(torch.equal(p, p.to(torch.bfloat16).float()) for p in params)
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def test_compute_dtype_auto_follows_the_cpus_bf16_instructions() -> None:
    cpu = torch.device("cpu")
    assert computes_bf16("float32", cpu) is False
    assert computes_bf16("bfloat16", cpu) is True
    # /proc/cpuinfo, not torch, is the witness of what the CPU has.
    assert computes_bf16("auto", cpu) is bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})
    with pytest.raises(ValueError, match="compute_dtype"):
        RLTrainerConfig(
            control="tcp://127.0.0.1:1",
            scheduler="tcp://127.0.0.1:2",
            published_store="x",
            model_dir=Path("m"),
            checkpoint_dir=Path("c"),
            compute_dtype="float16",  # type: ignore[arg-type]
        )


def test_equal_rewards_move_nothing() -> None:
    model = tiny_model(0)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    groups = sample_groups(model, [[1, 2, 3]], n=4, max_tokens=3, generator=g, reward=lambda c: 1.0)
    stats = train_step(model, opt, build_batch(groups), GRPOConfig())
    assert stats.grad_norm == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# -- a real learning signal -------------------------------------------------------------------

GOOD = 32  # the rewarded tokens: ids below 32, an eighth of the vocabulary


def _rewarded_mass(model: torch.nn.Module, prompts: list[list[int]]) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(prompts)).logits[:, -1].float()
    return logits.softmax(-1)[:, :GOOD].sum(-1).mean().item()


def test_grpo_steps_raise_the_probability_of_rewarded_tokens() -> None:
    """Sample from the model, reward the fraction of completion tokens below GOOD, train:
    at the daemon's default lr the rewarded mass on held-out prompts must rise clearly (from
    its chance level, 1/8), and the sampled reward with it."""
    torch.manual_seed(0)
    model = tiny_model(0)
    lr = RLTrainerConfig.__dataclass_fields__["lr"].default
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 256, (8, 4), generator=g).tolist()
    held_out = torch.randint(0, 256, (16, 4), generator=g).tolist()
    before = _rewarded_mass(model, held_out)
    rewards = []
    for _ in range(20):
        groups = sample_groups(
            model,
            prompts,
            n=8,
            max_tokens=6,
            generator=g,
            reward=lambda c: sum(t < GOOD for t in c) / len(c),
        )
        rewards.append(train_step(model, opt, build_batch(groups), GRPOConfig()).reward_mean)
    after = _rewarded_mass(model, held_out)
    assert 0.08 < before < 0.2
    assert after > 0.5, (before, after, rewards)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards
