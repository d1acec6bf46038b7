"""DPO and KTO on the tiny demo task: the policy trains, the reference stays frozen, the
first step sits exactly at the reference (loss log 2 / weight / 2), the precomputed and
online reference give the same step, and a LoRA run keeps the base (its reference) intact.
SimPO and ORPO: no reference is built or run, and the gold reward rises."""

from __future__ import annotations

import copy
import json
import math
import random

import pytest
import torch
from packed_models import PACKED, shared_rows

from rlhf_dist.config import PerfConfig, config_from_dict
from rlhf_dist.data.batching import BatchPlan
from rlhf_dist.data.rows import kto_examples, load_rows, preference_pairs
from rlhf_dist.demo import task
from rlhf_dist.evaluate import run_eval
from rlhf_dist.models import ValueModel, load_causal_lm, load_sequence_classifier
from rlhf_dist.trainers import preference
from rlhf_dist.trainers.dpo import dpo_step, train_dpo
from rlhf_dist.trainers.kto import kto_step, train_kto
from rlhf_dist.trainers.reward import rm_step


def _cfg(stage, sft_run, out, data, extra=None, **section):
    """A `stage` run from the session's SFT policy; data: the data section; extra: more
    sections (e.g. lora)."""
    return config_from_dict(
        {
            "run": {"output_dir": str(out), "seed": 0, "log_every": 1, "histogram_every": 4},
            "model": {"policy": str(sft_run.out / "final")},
            "data": data,
            stage: {"epochs": 1, "batch_size": 32, "micro_batch_size": 16, **section},
            **(extra or {}),
        }
    )


def _run_capturing_reference(monkeypatch, train_fn, cfg, runtime):
    """Run a trainer; return (summary, the frozen reference module it built, its state at
    build time)."""
    built = []
    original = preference.build_reference

    def capture(*args):
        ref = original(*args)
        state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        built.append((ref, state))
        return ref

    monkeypatch.setattr(preference, "build_reference", capture)
    import rlhf_dist.trainers.dpo as dpo_module
    import rlhf_dist.trainers.kto as kto_module

    monkeypatch.setattr(dpo_module, "build_reference", capture)
    monkeypatch.setattr(kto_module, "build_reference", capture)
    summary = train_fn(cfg, runtime)
    assert len(built) == 1
    return summary, *built[0]


def test_dpo_trains_the_policy_and_leaves_the_reference_and_inputs_alone(
    sft_run, task_env, runtime, tmp_path, data_cfg, read_jsonl, saved_state_dict, dir_digest,
    changed_tensors, monkeypatch,
):  # fmt: skip
    before = dir_digest(sft_run.out)
    out = tmp_path / "dpo"
    files = task_env.files
    data = data_cfg(train=str(files.prefs_train), eval=str(files.prefs_eval))
    cfg = _cfg("dpo", sft_run, out, data, reference_logprobs="online", optim={"lr": 1e-3})
    summary, reference, ref_state = _run_capturing_reference(monkeypatch, train_dpo, cfg, runtime)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "dpo/loss" in r] == list(range(1, 17))  # 512 pairs / 32
    # Step 1 is computed before any update: policy == reference, every log-ratio is 0.
    assert abs(rows[0]["dpo/loss"] - math.log(2)) < 1e-5
    assert abs(rows[0]["rewards/margins"]) < 1e-5 and rows[0]["rewards/accuracy"] <= 0.5
    for key in ("rewards/chosen", "rewards/rejected", "logprobs/chosen", "dpo/grad_norm"):
        assert all(math.isfinite(r[key]) for r in rows if "dpo/loss" in r), key
    # It learns the preference: held-out pairs ranked by the implicit reward.
    assert summary["eval_accuracy"] > 0.6 and summary["eval_margins"] > 0, summary
    assert summary["train_loss"] < math.log(2)
    # The trained weights moved; the frozen reference did not; the SFT run is untouched.
    assert changed_tensors(saved_state_dict(sft_run.out / "final"), saved_state_dict(out / "final"))
    for name, value in reference.state_dict().items():
        assert torch.equal(value, ref_state[name]), name
    assert not any(p.requires_grad for p in reference.parameters())
    assert dir_digest(sft_run.out) == before
    assert json.loads((out / "summary.json").read_text()) == summary


@pytest.mark.parametrize(
    "section",
    [{}, {"loss_type": "ipo", "beta": 0.5}, {"label_smoothing": 0.2}],
    ids=["sigmoid", "ipo", "cdpo"],
)
def test_dpo_precomputed_and_online_reference_give_the_same_steps(
    sft_run, task_env, runtime, tmp_path, data_cfg, read_jsonl, section
):
    rows = {}
    for mode in ("precompute", "online"):
        out = tmp_path / mode
        data = data_cfg(train=str(task_env.files.prefs_train))
        train_dpo(_cfg("dpo", sft_run, out, data, reference_logprobs=mode, **section), runtime)
        rows[mode] = [r for r in read_jsonl(out / "metrics.jsonl") if "dpo/loss" in r][:4]
    assert (tmp_path / "precompute" / preference.REFERENCE_FILE).is_file()
    assert not (tmp_path / "online" / preference.REFERENCE_FILE).exists()
    # The table is scored in other batches (other padding widths) than the training
    # forward: equal up to float32 rounding, not bitwise.
    for a, b in zip(rows["precompute"], rows["online"]):
        for key in ("dpo/loss", "rewards/margins", "rewards/chosen"):
            assert abs(a[key] - b[key]) < 1e-4, (key, a[key], b[key])
    # At the reference: sigmoid and cDPO lose log 2; IPO (0 - 1 / (2 beta))^2 = 1 at beta 0.5.
    first = 1.0 if section.get("loss_type") == "ipo" else math.log(2)
    assert abs(rows["online"][0]["dpo/loss"] - first) < 1e-5


def _unpaired_file(path, n_rows: int, seed: int = 3):
    """TRL-style unpaired rows: one completion each, labelled by its gold reward."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(n_rows):
            prompt, category = task.make_prompt(rng)
            completion = task.sample_response(rng, category, rng.random())
            label = task.gold_reward(completion) > 0.5
            f.write(json.dumps({"prompt": prompt, "completion": completion, "label": label}) + "\n")
    return path


def test_kto_trains_on_unpaired_examples_and_leaves_the_reference_alone(
    sft_run, runtime, tmp_path, data_cfg, read_jsonl, saved_state_dict, changed_tensors,
    monkeypatch,
):  # fmt: skip
    data = _unpaired_file(tmp_path / "unpaired.jsonl", 256)
    out = tmp_path / "kto"
    cfg = _cfg(
        "kto", sft_run, out, data_cfg(train=str(data)), desirable_weight=1.5, optim={"lr": 1e-3}
    )
    summary, reference, ref_state = _run_capturing_reference(monkeypatch, train_kto, cfg, runtime)
    assert summary["train_desirable"] + summary["train_undesirable"] == 256
    assert summary["train_desirable"] > 0 and summary["train_undesirable"] > 0
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "kto/loss" in r]
    assert len(rows) == 8
    # Step 1: every log-ratio and z0 are 0, so each loss is lambda_y * (1 - sigmoid(0)).
    first = rows[0]
    assert first["kto/kl"] == 0.0 and abs(first["rewards/margins"]) < 1e-6
    assert 0.5 <= first["kto/loss"] <= 0.75
    for key in ("rewards/desirable", "rewards/undesirable", "rewards/accuracy", "kto/grad_norm"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert rows[-1]["rewards/margins"] > 0, "desirable completions should gain on undesirable"
    assert all(r["kto/kl"] >= 0 for r in rows)
    assert changed_tensors(saved_state_dict(sft_run.out / "final"), saved_state_dict(out / "final"))
    for name, value in reference.state_dict().items():
        assert torch.equal(value, ref_state[name]), name


def test_kto_first_step_loss_weights_each_class(sft_run, runtime, tmp_path, data_cfg, read_jsonl):
    data = _unpaired_file(tmp_path / "unpaired.jsonl", 64, seed=5)
    out = tmp_path / "kto"
    w_d, w_u = 2.0, 0.5
    cfg = _cfg(
        "kto", sft_run, out, data_cfg(train=str(data)), batch_size=64,
        desirable_weight=w_d, undesirable_weight=w_u,
    )  # fmt: skip
    train_kto(cfg, runtime)
    first = read_jsonl(out / "metrics.jsonl")[0]
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    n_d = sum(r["label"] for r in rows)
    expected = (w_d * n_d + w_u * (64 - n_d)) * 0.5 / 64
    assert abs(first["kto/loss"] - expected) < 1e-6, (first["kto/loss"], expected)


def test_dpo_with_lora_trains_adapters_only_and_exports(
    sft_run, task_env, runtime, tmp_path, data_cfg, read_jsonl, saved_state_dict, monkeypatch
):
    built = []
    original = preference.add_adapters

    def capture(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(preference, "add_adapters", capture)
    out = tmp_path / "dpo_lora"
    lora = {"lora": {"enabled": True, "r": 4, "alpha": 8}}
    data = data_cfg(train=str(task_env.files.prefs_train))
    cfg = _cfg("dpo", sft_run, out, data, lora, optim={"lr": 3e-3})
    summary = train_dpo(cfg, runtime)
    assert len(built) == 1
    peft_model = built[0]
    base = saved_state_dict(sft_run.out / "final")
    # The base weights (the adapters-off reference) are the SFT weights, bitwise.
    for name, value in peft_model.state_dict().items():
        if "lora_" in name:
            continue
        plain = name.replace("base_model.model.", "").replace(".base_layer", "")
        assert torch.equal(value, base[plain].to(value.dtype)), name
    lora_b = [v for k, v in peft_model.state_dict().items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b), "adapters did not train"
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "dpo/loss" in r]
    assert abs(rows[0]["dpo/loss"] - math.log(2)) < 1e-5
    later = [r["dpo/loss"] for r in rows[8:]]
    assert sum(later) / len(later) < math.log(2), later
    assert summary["steps"] == 16
    assert (out / "final_adapter" / "adapter_config.json").is_file()
    merged = saved_state_dict(out / "final")
    assert any(not torch.equal(merged[k], base[k]) for k in base), "merged export == SFT"


def _no_reference(monkeypatch):
    """Make building or running a reference fail the test (the reference-free losses)."""
    import rlhf_dist.trainers.dpo as dpo_module

    def refuse(*args, **kwargs):
        raise AssertionError("a reference-free loss built or ran a reference model")

    for name in ("build_reference", "reference_logprobs", "reference_table"):
        monkeypatch.setattr(dpo_module, name, refuse)
    monkeypatch.setattr(preference, "AdapterOffReference", refuse)


def _gold(runtime, policy, reference, task_env, out, data_cfg) -> dict:
    """Gold reward and KL of `policy` on the task's 32 held-out prompts (the demo's eval)."""
    cfg = config_from_dict(
        {
            "run": {"output_dir": str(out), "seed": 0},
            "model": {"policy": str(policy)},
            "data": data_cfg(train=str(task_env.files.eval_prompts)),
            "generation": {"max_new_tokens": 24, "temperature": 0.7},
            "reward": {"function": "rlhf_dist.demo.task:gold_reward_fn"},
            "eval": {"reference": str(reference), "num_prompts": 32, "batch_size": 32,
                     "gold_function": "rlhf_dist.demo.task:gold_reward_eval"},
        }
    )  # fmt: skip
    return run_eval(cfg, runtime)


@pytest.mark.parametrize(
    "section",
    [
        # SimPO drifts without a reference: at lr 1e-3 its policy stops ending its reviews
        # (EOS rate 0.06) and the gold falls; 5e-4 keeps it (0.408 -> 0.668, measured).
        {"loss_type": "simpo", "beta": 2.5, "simpo_gamma": 0.5, "optim": {"lr": 5e-4}},
        {"loss_type": "orpo", "beta": 1.0, "optim": {"lr": 1e-3}},  # 0.408 -> 0.720
    ],
    ids=["simpo", "orpo"],
)
def test_reference_free_losses_raise_the_demo_gold_with_no_reference_model(
    section, sft_run, task_env, runtime, tmp_path, data_cfg, read_jsonl, saved_state_dict,
    changed_tensors, monkeypatch,
):  # fmt: skip
    """SimPO and ORPO on the demo's pairs: no reference model is built, loaded or run (any
    attempt fails the test), the policy learns the preference, and its gold reward on
    held-out prompts rises above the SFT policy's, as DPO's does (docs/dpo.md)."""
    _no_reference(monkeypatch)
    out = tmp_path / section["loss_type"]
    files = task_env.files
    data = data_cfg(train=str(files.prefs_train), eval=str(files.prefs_eval))
    summary = train_dpo(_cfg("dpo", sft_run, out, data, **section), runtime)
    assert not (out / preference.REFERENCE_FILE).exists()
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "dpo/loss" in r]
    assert len(rows) == 16
    names = ["rewards/chosen", "rewards/margins", "logprobs/chosen", "dpo/grad_norm"]
    if section["loss_type"] == "orpo":  # the NLL term and the odds ratio are logged
        names += ["dpo/nll", "dpo/log_odds_ratio"]
        assert all(r["dpo/loss"] > r["dpo/nll"] > 0 for r in rows)  # + lambda x L_OR > 0
        assert math.isfinite(summary["eval_nll"]) and math.isfinite(summary["eval_log_odds_ratio"])
    for key in names:
        assert all(math.isfinite(r[key]) for r in rows), key
    assert summary["eval_accuracy"] > 0.55 and summary["eval_margins"] > 0, summary
    assert changed_tensors(saved_state_dict(sft_run.out / "final"), saved_state_dict(out / "final"))
    sft = sft_run.out / "final"
    before = _gold(runtime, sft, sft, task_env, tmp_path / "eval_sft", data_cfg)
    after = _gold(runtime, out / "final", sft, task_env, tmp_path / "eval_new", data_cfg)
    assert after["gold_reward"] > before["gold_reward"] + 0.15, (before, after)


def test_reference_free_loss_with_lora_trains_adapters_and_no_adapters_off_reference(
    sft_run, task_env, runtime, tmp_path, data_cfg, read_jsonl, saved_state_dict, monkeypatch
):
    """ORPO with LoRA: the adapters-off base is not used as a reference (none is built or
    run), the adapters train and the base stays the SFT weights."""
    _no_reference(monkeypatch)
    built = []
    original = preference.add_adapters

    def capture(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(preference, "add_adapters", capture)
    out = tmp_path / "orpo_lora"
    lora = {"lora": {"enabled": True, "r": 4, "alpha": 8, "export": "adapter"}}
    pairs = tmp_path / "pairs.jsonl"  # 4 steps of 32 pairs
    pairs.write_text("".join(task_env.files.prefs_train.read_text().splitlines(True)[:128]))
    section = {"loss_type": "orpo", "beta": 1.0, "orpo_prompt_nll": False, "optim": {"lr": 3e-3}}
    train_dpo(_cfg("dpo", sft_run, out, data_cfg(train=str(pairs)), lora, **section), runtime)
    base = saved_state_dict(sft_run.out / "final")
    for name, value in built[0].state_dict().items():
        if "lora_" not in name:
            plain = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(value, base[plain].to(value.dtype)), name
    lora_b = [v for k, v in built[0].state_dict().items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b), "adapters did not train"
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "dpo/loss" in r]
    assert len(rows) == 4 and all(r["dpo/loss"] > r["dpo/nll"] > 0 for r in rows)
    assert (out / "final_adapter" / "adapter_config.json").is_file()


def _split_grads(step_fn, base, batch, plans):
    """(gradients, metrics) of one step_fn call per BatchPlan, each on a fresh copy; a
    ("packed", plan) entry: that step with perf.packed_sequences on."""
    out = []
    for plan in plans:
        model, perf = copy.deepcopy(base), PerfConfig()
        if isinstance(plan, tuple):
            perf, plan = PACKED, plan[1]
        metrics, _ = step_fn(model, batch, plan, perf)
        out.append(({n: p.grad.clone() for n, p in model.named_parameters()}, metrics))
    return out


@pytest.mark.parametrize("stage", ["dpo", "kto", "simpo", "orpo"])
def test_step_gradient_does_not_depend_on_the_micro_batch_split(
    stage, sft_run, task_env, runtime, data_cfg, monkeypatch
):
    """One optimizer step's gradient is that of the global-batch mean loss, however the
    batch is cut (4 micro-batches of 4, or by a token budget: sorted by length, different
    row counts), including KTO's reference point z0 (one number for the whole batch) and
    ORPO's NLL (a token mean over the whole batch: micro-batches hold different token
    counts)."""
    tok, pad = task_env.tokenizer, task_env.tokenizer.pad_token_id
    rows = load_rows(str(task_env.files.prefs_train), "data.train")[:16]
    data = config_from_dict({"data": data_cfg()}).data
    # Reference = the random-init model, so log-ratios (and z0) are far from 0.
    policy = load_causal_lm(str(sft_run.out / "final"), "model.policy")
    reference = load_causal_lm(str(task_env.policy), "model.policy").requires_grad_(False)
    if stage in ("dpo", "simpo", "orpo"):
        batch = preference_pairs(rows, tok, data)[0]
        loss_type = {"dpo": "sigmoid"}.get(stage, stage)
        section = config_from_dict({"dpo": {"loss_type": loss_type}}).dpo
        widths, rows_per_item = [max(len(p.chosen), len(p.rejected)) for p in batch], 2
        stage = "dpo"  # the metrics' prefix

        def step(model, items, plan, perf):
            return dpo_step(runtime, model, reference, items, None, plan, section, pad, perf)
    else:
        batch = kto_examples(rows, tok, data, config_from_dict({}).kto)[0][:16]
        section = config_from_dict({}).kto
        widths, rows_per_item = [len(ex.prompt) + len(ex.completion) for ex in batch], 1

        def step(model, items, plan, perf):
            return kto_step(runtime, model, reference, items, None, plan, section, pad, perf)

    budget = BatchPlan(16, 1, 16, micro_batch_tokens=3 * rows_per_item * max(widths))
    groups = budget.micro_batches(widths, 0, rows_per_item)
    assert len(groups) >= 3 and len({len(g) for g in groups}) >= 2, groups
    plans = (BatchPlan(16, 1, 16), BatchPlan(16, 1, 4), budget, ("packed", budget))
    rows = shared_rows(monkeypatch)  # packed: several sequences per packed row
    (whole, m_whole), *splits = _split_grads(step, policy, batch, plans)
    assert any(packed_rows < padded for padded, packed_rows in rows), rows
    loss = f"{stage}/loss"
    # model.packed_sequences (last): the budget's micro-batches packed, padding-free.
    for (split, m_split), tolerance in zip(splits, (1e-4, 1e-6, 1e-5)):
        assert m_split[loss] == pytest.approx(m_whole[loss], rel=1e-5)
        if stage == "kto":
            assert m_whole["kto/kl"] > 0
            assert m_split["kto/kl"] == pytest.approx(m_whole["kto/kl"])
        for name in whole:
            scale = whole[name].norm()
            assert scale > 0, name
            assert (split[name] - whole[name]).norm() <= tolerance * scale, name
    pad_fraction = f"{stage}/pad_fraction"
    assert 0 <= splits[1][1][pad_fraction] < m_whole[pad_fraction] < 1


def test_reward_model_gradient_same_with_a_token_budget(
    sft_run, task_env, runtime, data_cfg, monkeypatch
):
    """rm.micro_batch_tokens: pairs sorted by length in micro-batches of 2 x pairs x
    longest sequence within the budget; the step's gradient is the whole batch's."""
    tok, pad = task_env.tokenizer, task_env.tokenizer.pad_token_id
    rows = load_rows(str(task_env.files.prefs_train), "data.train")[:16]
    batch = preference_pairs(rows, tok, config_from_dict({"data": data_cfg()}).data)[0][:16]
    torch.manual_seed(0)  # the new head
    classifier = load_sequence_classifier(str(sft_run.out / "final"), "model.reward", new_head=True)
    base = ValueModel(classifier)
    widths = [max(len(p.chosen), len(p.rejected)) for p in batch]
    budget = BatchPlan(16, 1, 16, micro_batch_tokens=3 * 2 * max(widths))
    assert len(budget.micro_batches(widths, 0, rows_per_item=2)) >= 3

    def step(model, items, plan, perf):
        model.perf = perf  # the ValueModel's forward reads its perf (packed_models.packed)
        return rm_step(runtime, model, items, plan, pad)

    plans = (BatchPlan(16, 1, 16), budget, ("packed", budget))  # last: packed rows
    rows = shared_rows(monkeypatch)  # several sequences per packed row
    (whole, m_whole), *splits = _split_grads(step, base, batch, plans)
    assert any(packed_rows < padded for padded, packed_rows in rows), rows
    for (split, m_split), tolerance in zip(splits, (1e-6, 1e-5)):
        assert m_split["rm/loss"] == pytest.approx(m_whole["rm/loss"], rel=tolerance)
        assert m_split["rm/accuracy"] == m_whole["rm/accuracy"]
        for name in whole:
            scale = whole[name].norm()
            assert scale > 0, name
            assert (split[name] - whole[name]).norm() <= tolerance * scale, name
    m_split = splits[0][1]
    assert 0 <= m_split["rm/pad_fraction"] < m_whole["rm/pad_fraction"] < 1
