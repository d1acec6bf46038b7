"""LoRA keeps one copy of each base: the reference is the actor with adapters off and the
frozen reward model is the LoRA critic with adapters off, so they add no weights."""

from torch import nn

from rlhf_dist.config import config_from_dict
from rlhf_dist.data.batching import ppo_plan
from rlhf_dist.trainers.ppo.setup import build_models


def unique_parameter_bytes(*modules: nn.Module) -> int:
    """Bytes of distinct parameter storages across `modules` (shared weights count once)."""
    seen, total = set(), 0
    for module in modules:
        for p in module.parameters():
            storage = p.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def build(runtime, sft_run, rm_run, tmp_path, **lora):
    tree = {
        "run": {"output_dir": str(tmp_path)},
        "model": {"policy": str(sft_run.out / "final"), "reward": str(rm_run.out / "final")},
        "data": {"train": "unused.jsonl"},
        "ppo": {"rollout_batch_size": 8, "minibatch_size": 8, "micro_batch_size": 8},
        "lora": {"r": 4, **lora},
    }
    cfg = config_from_dict(tree)
    built = build_models(cfg, runtime, ppo_plan(cfg.ppo, 1), total_steps=1)
    trained = runtime.unwrap(built.model)
    return trained, built.reference, built.scorer.reward_model


def test_lora_reference_and_reward_model_hold_no_weights_of_their_own(
    runtime, sft_run, rm_run, tmp_path
):
    trained, reference, reward_model = build(
        runtime, sft_run, rm_run, tmp_path, enabled=True, critic=True
    )
    alone = unique_parameter_bytes(trained)
    assert unique_parameter_bytes(trained, reference, reward_model) == alone
    # Full fine-tuning, for contrast: a frozen copy each of the policy and the reward model.
    full, full_ref, full_rm = build(runtime, sft_run, rm_run, tmp_path / "full")
    assert unique_parameter_bytes(full, full_ref, full_rm) > 1.8 * unique_parameter_bytes(full)
    print(
        f"LoRA: all four models {alone} bytes; full: {unique_parameter_bytes(full, full_ref, full_rm)} bytes"
    )
