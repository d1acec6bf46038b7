"""SFT on the tiny demo task: it learns, writes the documented run outputs, and its gradient
does not depend on how a batch is cut into micro-batches (docs/architecture.md sections 4 and 8)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import yaml
from packed_models import PACKED, shared_rows

from rlhf_dist.config import PerfConfig, load_config, to_dict
from rlhf_dist.data.batching import BatchPlan
from rlhf_dist.data.rows import collate_sft, load_rows, sft_examples
from rlhf_dist.models import load_causal_lm
from rlhf_dist.trainers.sft import causal_lm_logprobs, eval_nll, sft_step, token_nll_sum


@pytest.fixture(scope="module")
def fixed_examples(task_env, sft_run):
    """64 SFT examples, the same for every measurement of the loss."""
    rows = load_rows(str(task_env.files.sft), "data.train")[:64]
    examples, report = sft_examples(rows, task_env.tokenizer, sft_run.cfg.data)
    assert report.kept == 64, report.summary("fixed batch")
    return examples


def test_sft_changes_weights_and_lowers_the_response_loss(
    sft_run, task_env, runtime, fixed_examples, saved_state_dict, changed_tensors
):
    before = saved_state_dict(task_env.policy)
    after = saved_state_dict(sft_run.out / "final")
    # Every weight tensor (embeddings, attention, MLP, norms, lm_head) receives gradient.
    assert changed_tensors(before, after) == list(before), "some weights were not trained"

    pad = task_env.tokenizer.pad_token_id
    initial = load_causal_lm(str(task_env.policy), "model.policy")
    trained = load_causal_lm(str(sft_run.out / "final"), "model.policy")
    nll_before = eval_nll(runtime, initial, fixed_examples, 16, pad)
    nll_after = eval_nll(runtime, trained, fixed_examples, 16, pad)
    # A random model over the ~100-word vocabulary starts near ln(100) ~ 4.6 nats per token;
    # the grammar's entropy is far lower: 96 steps get to ~2 (the full demo SFT to ~1.6).
    assert nll_before > 4.0
    assert nll_after < 0.6 * nll_before, (nll_before, nll_after)


def test_sft_writes_the_documented_run_outputs(sft_run, task_env, read_jsonl):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = sft_run.out
    # config.yaml is the effective config: reading it back gives the same Config.
    assert yaml.safe_load((out / "config.yaml").read_text())["sft"]["optim"]["lr"] == 3e-3
    assert to_dict(load_config(out / "config.yaml")) == to_dict(sft_run.cfg)

    rows = read_jsonl(out / "metrics.jsonl")
    steps = [r["step"] for r in rows]
    # log_every=8 over 96 steps: steps 8, 16, ..., 96 (the last step is always logged).
    assert steps == list(range(8, 97, 8))
    assert all(math.isfinite(r["sft/loss"]) for r in rows)
    assert rows[-1]["sft/loss"] < rows[0]["sft/loss"]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 96 and summary["train_examples"] == 1024
    assert summary["train_loss"] == pytest.approx(rows[-1]["sft/loss"])

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    assert model.config.vocab_size == len(tok) == len(task_env.tokenizer)
    # The tokenizer is exported as it shipped (here with a PAD distinct from EOS).
    assert tok.pad_token_id == task_env.tokenizer.pad_token_id != tok.eos_token_id
    assert (
        tok("review of the hotel :")["input_ids"]
        == task_env.tokenizer("review of the hotel :")["input_ids"]
    )


def test_sft_gradient_does_not_depend_on_the_micro_batch_split(
    task_env, runtime, sft_run, monkeypatch
):
    rows = load_rows(str(task_env.files.sft), "data.train")[100:116]
    examples, _ = sft_examples(rows, task_env.tokenizer, sft_run.cfg.data)
    pad = task_env.tokenizer.pad_token_id
    # Ragged lengths are what makes a per-micro-batch mean differ from the global mean.
    assert len({len(ex.ids) - ex.prompt_len for ex in examples}) >= 4
    base = load_causal_lm(str(task_env.policy), "model.policy")

    def grads_and_metrics(plan, packing=False):
        model = copy.deepcopy(base)
        perf = PACKED if packing else PerfConfig()
        metrics, _ = sft_step(runtime, model, examples, plan, pad, perf)
        return {n: p.grad.clone() for n, p in model.named_parameters()}, metrics

    whole, m_whole = grads_and_metrics(BatchPlan(16, 1, 16))
    # A token budget of 3 longest rows: sorted by length, several micro-batches of
    # different row counts (sft.micro_batch_tokens).
    longest = max(len(ex.ids) for ex in examples)
    budget = BatchPlan(16, 1, 16, micro_batch_tokens=3 * longest)
    groups = budget.micro_batches([len(ex.ids) for ex in examples], 0)
    assert len(groups) >= 4 and len({len(g) for g in groups}) >= 2, groups
    for plan, tolerance in ((BatchPlan(16, 1, 4), 1e-5), (budget, 1e-6)):
        split, m_split = grads_and_metrics(plan)
        assert m_split["sft/loss"] == pytest.approx(m_whole["sft/loss"], rel=1e-6)
        for name in whole:
            scale = whole[name].norm()
            assert scale > 0, name
            assert (split[name] - whole[name]).norm() <= tolerance * scale, name
    # Rows of similar length share a micro-batch (m_split: the budget's): less padding
    # than one batch of 16.
    assert 0 <= m_split["sft/pad_fraction"] < m_whole["sft/pad_fraction"] < 1
    # model.packed_sequences: each micro-batch's rows packed, padding-free, by 4 and by
    # the token budget, several sequences per packed row; the gradient of the padded 16.
    rows = shared_rows(monkeypatch)
    for plan in (BatchPlan(16, 1, 4), budget):
        split, m_split = grads_and_metrics(plan, packing=True)
        assert m_split["sft/loss"] == pytest.approx(m_whole["sft/loss"], rel=1e-5)
        for name in whole:
            assert (split[name] - whole[name]).norm() <= 1e-5 * whole[name].norm(), name
    assert any(packed_rows < padded for padded, packed_rows in rows), rows

    # Control: the naive recipe (mean over each micro-batch's own tokens, averaged over
    # micro-batches) gives a visibly different gradient on this batch, so the equality
    # above is a property of sft_step and not of the data.
    model = copy.deepcopy(base)
    for s in BatchPlan(16, 1, 4).micro_slices():
        nll_sum, count = token_nll_sum(
            model, collate_sft(examples[s], pad), causal_lm_logprobs(PerfConfig())
        )
        (nll_sum / count / 4).backward()
    naive = dict(model.named_parameters())
    total = torch.stack([whole[n].norm() ** 2 for n in whole]).sum().sqrt()
    gap = torch.stack([(naive[n].grad - whole[n]).norm() ** 2 for n in whole]).sum().sqrt()
    assert gap > 1e-2 * total  # seen: 7% of the gradient's norm, vs <1e-6 for sft_step


def test_sft_with_lora_trains_adapters_only_and_exports_both(
    task_env, runtime, tmp_path, read_jsonl, saved_state_dict
):
    """lora.enabled in SFT (as in TRL's SFTTrainer with a peft_config): the base weights
    stay the policy's, the adapters train, and final/ (merged) and final_adapter/ are written."""
    from rlhf_dist.config import config_from_dict
    from rlhf_dist.trainers.sft import train_sft

    out = tmp_path / "sft_lora"
    cfg = config_from_dict(
        {
            "run": {"output_dir": str(out), "seed": 0, "log_every": 1},
            "model": {"policy": str(task_env.policy)},
            "data": {"train": str(task_env.files.sft), "max_length": 64},
            "sft": {"epochs": 1, "batch_size": 32, "micro_batch_size": 32, "optim": {"lr": 3e-3}},
            "lora": {"enabled": True, "r": 4, "alpha": 8, "export": "both"},
        }
    )
    summary = train_sft(cfg, runtime)
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "sft/loss" in r]
    assert summary["steps"] == len(rows) > 1
    assert rows[-1]["sft/loss"] < rows[0]["sft/loss"]
    assert (out / "final_adapter" / "adapter_config.json").is_file()
    base, merged = saved_state_dict(task_env.policy), saved_state_dict(out / "final")
    assert set(merged) == set(base)
    assert any(not torch.equal(merged[k], base[k].to(merged[k].dtype)) for k in base)
    # adapters sit on the attention projections only: every other tensor is the policy's
    for name, value in merged.items():
        if "proj" not in name:
            assert torch.equal(value, base[name].to(value.dtype)), name
