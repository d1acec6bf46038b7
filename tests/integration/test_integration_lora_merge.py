"""LoRA adapters folded into the base for generation: the same logits and tokens as the
unmerged model, and the base weights given back bitwise afterwards."""

import pytest
import torch

from rlhf_dist.config import GenerationConfig, LoRAConfig
from rlhf_dist.engine.decode import generate
from rlhf_dist.models.lora import add_adapters, merged_adapters


@pytest.fixture
def lora_actor(task_env):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(task_env.policy))
    model = add_adapters(model, LoRAConfig(enabled=True, r=4, alpha=8), "CAUSAL_LM")
    with torch.no_grad():  # B starts at 0 (adapter = identity): make the adapters matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return model.eval()


def _inputs(task_env):
    ids = torch.tensor([[task_env.tokenizer.pad_token_id, 5, 6, 7], [8, 9, 10, 11]])
    mask = (ids != task_env.tokenizer.pad_token_id).long()
    return ids, mask


def test_merged_logits_equal_unmerged(lora_actor, task_env):
    ids, mask = _inputs(task_env)
    with torch.no_grad():
        unmerged = lora_actor(input_ids=ids, attention_mask=mask).logits
        base = lora_actor.get_base_model()
        with lora_actor.disable_adapter():
            plain = lora_actor(input_ids=ids, attention_mask=mask).logits
        before = {n: p.detach().clone() for n, p in base.named_parameters()}
        with merged_adapters(lora_actor) as m:
            merged = m(input_ids=ids, attention_mask=mask).logits
    assert (unmerged - plain).abs().max() > 1e-3  # the adapters change the output...
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)  # ...merging does not
    after = dict(base.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)  # given back bitwise
    with torch.no_grad():  # adapters are active again after the context
        again = lora_actor(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(again, unmerged, atol=0, rtol=0)


def test_greedy_generation_same_with_merged_adapters(lora_actor, task_env):
    ids, mask = _inputs(task_env)
    gen = GenerationConfig(max_new_tokens=6, temperature=1.0, top_k=1)
    unmerged = generate(lora_actor, ids, mask, gen, task_env.tokenizer)
    with merged_adapters(lora_actor) as m:
        merged = generate(m, ids, mask, gen, task_env.tokenizer)
    assert torch.equal(merged, unmerged)


def test_merged_adapters_restore_after_an_error(lora_actor):
    base = lora_actor.get_base_model()
    weights = {n: p for n, p in base.named_parameters() if "base_layer.weight" in n}
    with pytest.raises(RuntimeError), merged_adapters(lora_actor):
        raise RuntimeError("generation failed")
    assert all(dict(base.named_parameters())[n] is p for n, p in weights.items())
