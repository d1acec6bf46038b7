"""On-policy distillation in the PPO loop (docs/distill.md):

- ppo.estimator=distill with no reward at all: the student (the actor) trains, the teacher
  and the reference stay frozen, and the student's reverse KL to the teacher falls (the
  student is the SFT policy, the teacher the random-init one: a teacher far from the
  student, reached in a few steps; the demo's real case is docs/distill.md's benchmark);
- GJSD mixed with GRPO's task reward: the teacher runs in the update and its divergence
  is logged and falls;
- a teacher with another tokenizer is one ConfigError naming model.teacher, found before
  any weights load.
"""

from __future__ import annotations

import pytest
from spies import capture_calls

from rlhf_dist.config import ConfigError, config_from_dict
from rlhf_dist.trainers import ppo
from rlhf_dist.trainers.ppo import setup as ppo_setup

POSITIVE_REWARD = "rlhf_dist.demo.task:positive_word_reward"


def tree_for(out, student, teacher, data, **ppo_keys) -> dict:
    return {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1},
        "model": {"policy": str(student), "teacher": str(teacher)},
        "data": data,
        "generation": {"max_new_tokens": 16, "temperature": 0.7},
        "ppo": {
            "iterations": 4,
            "rollout_batch_size": 16,
            "rollout_micro_batch_size": 16,
            "minibatch_size": 16,
            "micro_batch_size": 8,
            "optim": {"lr": 2e-3},
            "kl_coef": 0.01,  # a reference too: it must stay frozen beside the teacher
            "estimator": "distill",
            **ppo_keys,
        },
    }


def test_distillation_alone_trains_the_student_towards_a_frozen_teacher(
    sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg, saved_state_dict,
    changed_tensors, read_jsonl,
):  # fmt: skip
    student, teacher = sft_run.out / "final", task_env.policy
    built = capture_calls(monkeypatch, ppo_setup, "build_models")
    out = tmp_path / "distill"
    tree = tree_for(out, student, teacher, data_cfg(train=str(task_env.files.prompts)))
    ppo.train_ppo(config_from_dict(tree), runtime)

    ((_, _, models),) = built
    net = runtime.unwrap(models.model)
    assert net.critic is None and models.group_names == ("actor",)
    initial = saved_state_dict(student)
    actor = {k: v.detach().clone() for k, v in net.actor.state_dict().items()}
    assert changed_tensors(initial, actor) == list(initial)
    assert changed_tensors(initial, models.reference.state_dict()) == []
    assert changed_tensors(saved_state_dict(teacher), models.teacher.state_dict()) == []
    assert not any(p.requires_grad for p in models.teacher.parameters())

    rows = read_jsonl(out / "metrics.jsonl")
    kl = [r["distill/reverse_kl_per_token"] for r in rows]
    assert len(kl) == 4 and all(k == k for k in kl)  # logged every iteration, finite
    assert kl[-1] < 0.7 * kl[0], kl
    assert all(r["objective/score"] == 0.0 for r in rows)  # no reward: nothing else trains
    # the same sum per response: mean length x the per-token mean
    per_response = rows[0]["rollout/length"] * kl[0]
    assert rows[0]["distill/reverse_kl"] == pytest.approx(per_response, rel=1e-6)


def test_gjsd_mixed_with_grpo_runs_the_teacher_in_the_update(
    sft_run, task_env, runtime, tmp_path, data_cfg, read_jsonl
):
    student, teacher = sft_run.out / "final", task_env.policy
    out = tmp_path / "gjsd"
    keys = {"estimator": "grpo", "rollout_batch_size": 4, "samples_per_prompt": 4}
    keys |= {"distill_loss": "gjsd", "distill_beta": 0.5, "distill_coef": 2.0, "iterations": 4}
    tree = tree_for(out, student, teacher, data_cfg(train=str(task_env.files.prompts)), **keys)
    tree["reward"] = {"function": POSITIVE_REWARD}
    ppo.train_ppo(config_from_dict(tree), runtime)
    rows = read_jsonl(out / "metrics.jsonl")
    gjsd = [r["distill/gjsd"] for r in rows]
    assert all(0 < g < 1 for g in gjsd), gjsd  # JSD(1/2) is below log 2 per token
    assert gjsd[-1] < gjsd[0], gjsd


def test_a_teacher_with_another_tokenizer_is_one_line_naming_the_key_before_any_load(
    sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg
):
    # A teacher directory with a tokenizer alone (one extra token): no weights to load.
    teacher = tmp_path / "other_tokenizer"
    tokenizer = type(task_env.tokenizer).from_pretrained(sft_run.out / "final")
    tokenizer.add_tokens(["zyzzyva"])
    tokenizer.save_pretrained(teacher)

    def no_load(*args, **kwargs):
        raise AssertionError("weights loaded before the tokenizer check")

    monkeypatch.setattr(ppo_setup, "load_causal_lm", no_load)
    tree = tree_for(
        tmp_path / "out",
        sft_run.out / "final",
        teacher,
        data_cfg(train=str(task_env.files.prompts)),
    )
    with pytest.raises(ConfigError) as info:
        ppo.train_ppo(config_from_dict(tree), runtime)
    message = str(info.value)
    assert message.startswith("model.teacher:") and "\n" not in message
    assert "tokenizer" in message
