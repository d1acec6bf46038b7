"""Gradient checkpointing (model.gradient_checkpointing): the same gradients, fewer saved
activations, for the actor-critic of full fine-tuning and of LoRA."""

import pytest
import torch

from rlhf_dist.config import LoRAConfig
from rlhf_dist.models import (
    ActorCritic,
    ValueModel,
    enable_gradient_checkpointing,
    load_causal_lm,
    load_sequence_classifier,
)
from rlhf_dist.models.lora import add_adapters


def actor_critic(task_env, lora: bool, checkpointing: bool) -> ActorCritic:
    torch.manual_seed(0)
    actor = load_causal_lm(str(task_env.policy), "model.policy")
    classifier = load_sequence_classifier(str(task_env.reward), "model.reward", new_head=True)
    if lora:
        cfg = LoRAConfig(enabled=True, r=4, alpha=8)
        actor = add_adapters(actor, cfg, "CAUSAL_LM")
        classifier = add_adapters(classifier, cfg, "SEQ_CLS", "score")
        for m in (actor, classifier):  # non-zero B, so adapter gradients are not trivial
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    torch.nn.init.normal_(p, 0.0, 0.05, generator=torch.Generator().manual_seed(1))
    if checkpointing:
        enable_gradient_checkpointing(actor)
        enable_gradient_checkpointing(classifier)
    return ActorCritic(actor, ValueModel(classifier)).train()


def loss_and_saved_bytes(model: ActorCritic, ids, mask, T: int):
    """Backward of a loss over log-probs, entropies and values; returns {name: grad} and the bytes autograd
    saved for backward (the activation memory checkpointing trades for recomputation)."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    response_mask = mask[:, -T:].bool()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, entropy, values = model(ids, mask, response_mask, 0.7, True)
        loss = logprobs.mean() + entropy.mean() + values.pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, sum(saved)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_checkpointing_same_gradients_less_activation_memory(task_env, lora):
    torch.manual_seed(2)
    ids = torch.randint(3, len(task_env.tokenizer), (4, 24))
    mask = torch.ones_like(ids)
    plain, plain_bytes = loss_and_saved_bytes(actor_critic(task_env, lora, False), ids, mask, 8)
    ckpt, ckpt_bytes = loss_and_saved_bytes(actor_critic(task_env, lora, True), ids, mask, 8)
    assert plain.keys() == ckpt.keys() and len(plain) > 0
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-5, rtol=1e-5, msg=name)
    # Only the layer inputs stay saved; every layer's attention/MLP intermediates go.
    assert ckpt_bytes < 0.6 * plain_bytes, (ckpt_bytes, plain_bytes)
    print(f"saved for backward: {plain_bytes} -> {ckpt_bytes} bytes")
