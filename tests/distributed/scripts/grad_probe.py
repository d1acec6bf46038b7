"""Gradient of ONE PPO optimizer step on a fixed global minibatch of 8 sequences.

Usage: grad_probe.py POLICY REWARD OUT VARIANT [VARIANT ...] [--uneven-generation=PROMPTS]
  [--check-reduce] [--sequence-parallel-probe=SP_OUT:LENGTH]
  VARIANT = NAME:MICRO_BATCH_SIZE[:FLAG...], FLAG one of --gradient-checkpointing,
  --aggregation=MODE, --critic-free, --whole-weights, --ratio-level=sequence,
  --policy-loss=cispo, --overlong-mask, --tokens=N, --packed, --cov-control=METHOD,
  --lora, --sequence-parallel
(--distill=LOSS: on-policy distillation from a teacher (the policy with its weights
perturbed, written next to OUT once), ppo.distill_loss=LOSS (reverse_kl: the rollout's
teacher log-probs as an advantage; gjsd: the teacher run on every micro-batch and GJSD
over the vocabulary in the loss); --teacher-partition: the teacher placed with
distributed.frozen_models=partition (ZeRO-3: its forward a collective, its head gathered
once per micro-batch).
--lora: LoRA adapters (r=4) on every linear of the actor. --sequence-parallel:
distributed.sequence_parallel_size=2 (2 ranks: both hold both shares and split each
micro-batch by columns; engine/sequence_parallel.py).
--packed: perf.packed_sequences, every forward of the step on packed rows, here of twice
the padded width, so that the minibatch's sequences share rows; the variant also records
{"packed_rows": {NAME: [padded rows, packed rows] summed over its forwards}}.
--critic-free: the grpo estimator, so no critic, with KL as a k3 loss term, an entropy
bonus, clip-higher and dual clip: every term of the loss in one gradient. --whole-weights:
the backward runs inside runtime.training_weights(model, "always"), as the trainers' steps
do, instead of through ZeRO-3's per-layer fetching. --ratio-level / --policy-loss set
ppo.ratio_level / ppo.policy_loss: GSPO, CISPO (cispo drops --critic-free's dual clip).
--overlong-mask: rows 0, 1 and 5 are truncated and masked out of the loss as
ppo.overlong=mask does, so rank 0's first micro-batch has no loss token at all. --tokens=N: ppo.micro_batch_tokens=N,
the share cut by that token budget as ppo_update does (`update_micro_batches`: sorted by
length, as many passes on every rank as the busiest needs); the variant then also records
{"micro_counts": {NAME: {"greedy": [passes each rank's budget alone needs],
"passes": [passes each rank ran]}}}. --cov-control=clip_cov|kl_cov: ppo.cov_control on 10%
of the tokens, chosen as ppo_iteration does (trainers/ppo/entropy.py: each rank from its
share, with global means, counts and top-k), passed to the backward; the variant also
records {"cov_chosen": {NAME: [(global row, column) of every chosen token, all ranks]}}.)
Run plainly (1 rank) or under `accelerate launch` (2 ranks): every rank builds the same
global minibatch with ragged response lengths, takes its share, and accumulates the
gradient over its micro-batches with the trainer's own `minibatch_backward`. Each variant
builds its own models in this one process (one interpreter and one process group start-up
for all of them; the RNGs are re-seeded per variant, so a variant's models are the same
whichever variants ran before it). Rank 0 writes {"gradients": {NAME: {param: full
gradient}}, "checkpoint_optimizer": {NAME: class name}} to OUT, so tests can compare splits
and check that the checkpoint code reaches the torch AdamW inside every backend's wrappers
(Accelerate's, DeepSpeed's ZeRO optimizer). With --uneven-generation, the same launch then
runs uneven_generation.py's check (ranks generating different lengths must not hang) in
both generation modes and adds {"uneven_widths": {gather: widths of all ranks}}: one
process group start-up less for the 2-rank tests. Under ZeRO-3 each variant also records
{"zero3": {NAME: {"fetches": weight-fetch collectives of the backward, "restored": hooks,
F.linear and partitioning as before}}}; --check-reduce adds {"reduce_max_diff": ...}:
zero3.py's all-reduce gradient reduction against DeepSpeed's reduce-scatter.
--sequence-parallel-probe then runs sp_probe.py's cases at LENGTH tokens in the same
process group (its result in SP_OUT): one launch for both under DDP.
"""

import contextlib
import dataclasses
import sys

import torch

from rlhf_dist.algo.objectives import drop_truncated
from rlhf_dist.config import config_from_dict
from rlhf_dist.data.batching import ppo_plan, token_budget_split
from rlhf_dist.distributed import Runtime, seed_everything
from rlhf_dist.distributed.process_exit import end_process
from rlhf_dist.distributed.training_state import innermost_optimizer
from rlhf_dist.engine import packing as engine_packing
from rlhf_dist.models import quiet_transformers
from rlhf_dist.rollout import RolloutBatch
from rlhf_dist.trainers.ppo.entropy import cov_choice
from rlhf_dist.trainers.ppo.setup import build_models
from rlhf_dist.trainers.ppo.update import (
    Teacher,
    UpdateKnobs,
    minibatch_backward,
    update_micro_batches,
)

B, P, T, VOCAB = 8, 5, 7, 100

CRITIC_FREE = {
    "estimator": "grpo",
    "samples_per_prompt": 2,
    "kl_placement": "loss",
    "kl_kind": "k3",
    "entropy_coef": 0.01,
    "clip_eps_high": 0.28,
    "dual_clip": 3.0,
}


def full_gradients(backend, model) -> dict[str, torch.Tensor]:
    """{name: full gradient} of the trainable parameters, after backward and before the
    optimizer step, to compare (moved here from distributed/training_state.py: only this
    probe needs it; under ZeRO-3 and FSDP2 the partitions are gathered: every rank must call)."""
    named = [(n, p) for n, p in backend.unwrap(model).named_parameters() if p.requires_grad]
    if backend.zero_stage is None:  # FSDP2's gradients are DTensor shards: gathered whole
        whole = [
            (n, getattr(p.grad, "full_tensor", p.grad.detach))
            for n, p in named
            if p.grad is not None
        ]
        return {n: full().detach().clone() for n, full in whole}
    from deepspeed.utils import safe_get_full_grad

    grads = {n: safe_get_full_grad(p) for n, p in named}
    return {n: g.detach().float().clone() for n, g in grads.items() if g is not None}


def fixed_minibatch():
    g = torch.Generator().manual_seed(1234)
    lengths = torch.tensor([1, 7, 3, 5, 2, 7, 4, 6])  # ragged: token counts differ per rank
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[::3, :2] = 0  # some left padding
    batch = RolloutBatch(
        prompt_ids=torch.randint(4, VOCAB, (B, P), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.where(mask, torch.randint(4, VOCAB, (B, T), generator=g), 0),
        response_mask=mask,
        old_logprobs=-torch.rand(B, T, generator=g) * 3,
        ref_logprobs=-torch.rand(B, T, generator=g) * 3,
        old_values=torch.randn(B, T, generator=g),
        scores=torch.randn(B, generator=g),
        raw_scores=torch.randn(B, generator=g),
        finished=torch.ones(B, dtype=torch.bool),
        entropy=torch.zeros(B, T),
    )
    advantages, returns = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    teacher = -torch.rand(B, T, generator=g) * 3  # drawn last: the other draws stay the same
    batch = dataclasses.replace(batch, teacher_logprobs=torch.where(mask, teacher, 0.0))
    return batch, advantages, returns


def write_teacher(policy: str, out: str) -> None:
    """A teacher for --distill: the policy with seeded noise on every weight, written once
    by the main process next to OUT (other ranks wait at the barrier after)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = f"{out}.teacher"
    model = AutoModelForCausalLM.from_pretrained(policy)
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(policy).save_pretrained(path)


def flag_value(flags: list[str], name: str, default: str) -> str:
    return next((f.split("=", 1)[1] for f in flags if f.startswith(f"--{name}=")), default)


def variant_config(policy: str, reward: str, micro: int, flags: list[str], teacher: str = ""):
    checkpointing = "--gradient-checkpointing" in flags
    aggregation = flag_value(flags, "aggregation", "token_mean")
    objective = {
        "ratio_level": flag_value(flags, "ratio-level", "token"),
        "policy_loss": flag_value(flags, "policy-loss", "clip"),
    }
    tree = {
        "model": {
            "policy": policy,
            "reward": reward,
            "gradient_checkpointing": checkpointing,
        },
        "perf": {"packed_sequences": "--packed" in flags},
        "data": {"train": "unused.jsonl"},
        "ppo": {
            "rollout_batch_size": B,
            "minibatch_size": B,
            "micro_batch_size": micro,
            "micro_batch_tokens": int(flag_value(flags, "tokens", "0")),
            "value_clip_eps": 0.2,
            "loss_aggregation": aggregation,
            **(CRITIC_FREE if "--critic-free" in flags else {}),
            **objective,
        },
    }
    cov = flag_value(flags, "cov-control", "none")
    if cov != "none":  # 10% of the 35 tokens; every token a Clip-Cov candidate
        tree["ppo"] |= {"cov_control": cov, "cov_ratio": 0.1, "cov_clip_low": -100.0}
    if objective["policy_loss"] == "cispo":
        tree["ppo"]["dual_clip"] = None
    distill = flag_value(flags, "distill", "")
    if distill:
        tree["model"]["teacher"] = teacher
        tree["ppo"] |= {"distill_loss": distill, "distill_coef": 2.0, "distill_beta": 0.3}
    if "--teacher-partition" in flags:
        tree["distributed"] = {"frozen_models": "partition"}
    if "--lora" in flags:  # every linear; B starts at 0, so the A gradients are 0 at step 1
        tree["lora"] = {"enabled": True, "r": 4, "alpha": 8}
    if "--sequence-parallel" in flags:
        tree.setdefault("distributed", {})["sequence_parallel_size"] = 2
    return config_from_dict(tree)


def probe(runtime, cfg, whole: bool, overlong_mask: bool = False) -> tuple[dict, str, dict]:
    """(full gradients of one step, class name of the optimizer checkpoints read, ZeRO-3
    facts of the backward: weight-fetch collectives run, and whether hooks, F.linear and
    partitioning are as they were before it)."""
    seed_everything(0)  # as a fresh process with Runtime(seed=0) would be
    plan = ppo_plan(cfg.ppo, runtime.world_size)
    built = build_models(cfg, runtime, plan, total_steps=1)
    built.model.train()  # as ppo_iteration does before the update (checkpointing is train-only)
    batch, advantages, returns = fixed_minibatch()
    if overlong_mask:  # as ppo_iteration does with ppo.overlong=mask
        finished = batch.finished.clone()
        finished[[0, 1, 5]] = False
        mask = drop_truncated(batch.response_mask, finished)
        batch = dataclasses.replace(batch, finished=finished, response_mask=mask)
    share = plan.update.rank_slice(runtime.rank)
    mb = batch.select(share)
    slices = update_micro_batches(runtime, mb, plan.update)
    knobs = UpdateKnobs.from_config(cfg, group_names=built.group_names)
    chosen, _ = cov_choice(runtime, mb, advantages[share], cfg.ppo, seed=0, it=1)
    setting = "always" if whole else "never"
    before = zero3_state(runtime, built.model)
    teacher = None if built.teacher is None else Teacher(built.teacher, cfg.perf)
    with count_fetches(runtime) as fetches, runtime.training_weights(built.model, setting):
        minibatch_backward(
            runtime,
            built.model,
            mb,
            advantages[share],
            returns[share],
            knobs,
            slices,
            chosen=chosen,
            teacher=teacher,
        )
    facts = {"fetches": fetches[0], "restored": zero3_state(runtime, built.model) == before}
    if chosen is not None:  # (global row, column) of every rank's chosen tokens
        rows, cols = chosen.nonzero(as_tuple=True)
        start = share.start
        facts["cov_chosen"] = sorted(runtime.gather_objects(
            [(start + r, c) for r, c in zip(rows.tolist(), cols.tolist())]
        ))  # fmt: skip
    if built.teacher is not None:  # placed as distributed.frozen_models says
        facts["teacher_partitioned"] = any(hasattr(p, "ds_id") for p in built.teacher.parameters())
    grads = full_gradients(runtime.backend, built.model)
    if whole:  # an error inside whole weights leaves ZeRO-3 as it was too
        with contextlib.suppress(ArithmeticError), runtime.whole_weights(built.model):
            raise ArithmeticError("raised inside whole weights")
        facts["restored"] &= zero3_state(runtime, built.model) == before
    if plan.update.micro_batch_tokens:
        facts["micro_counts"] = micro_counts(runtime, mb, plan.update, len(slices))
    inner = type(innermost_optimizer(built.optimizer))
    return grads, f"{inner.__module__}.{inner.__qualname__}", facts


def micro_counts(runtime, mb, plan, passes: int) -> dict:
    """Every rank's micro-batch count under the token budget alone, and the passes run."""
    response = mb.response_mask.sum(1).clamp(min=1)  # as update_micro_batches
    widths = torch.stack([mb.prompt_mask.sum(1), response], dim=1).tolist()
    greedy = len(token_budget_split(widths, plan.micro_batch_tokens))
    return {
        "greedy": runtime.gather_objects([greedy]),
        "passes": runtime.gather_objects([passes]),
    }


def zero3_state(runtime, engine) -> tuple | None:
    """What whole_weights must leave as it found it: the number of ZeRO-3 module hooks,
    torch's F.linear (ZeRO-3's replacement), every weight partitioned."""
    if runtime.zero_stage != 3:
        return None
    offload = engine.optimizer.parameter_offload
    hooks = len(offload.forward_hooks) + len(offload.backward_hooks)
    partitioned = all(p.ds_status.name == "NOT_AVAILABLE" for p in engine.module.parameters())
    return hooks, torch.nn.functional.linear, partitioned


@contextlib.contextmanager
def count_fetches(runtime):
    """Count the collectives ZeRO-3 fetches weights with in the body (yields a one-item
    list): all-gathers, or on gloo the asynchronous all-reduces that replace them
    (deepspeed_config.fill_gloo_zero3); gradient and norm reductions are synchronous."""
    count = [0]
    if runtime.zero_stage != 3:
        yield count
        return
    import deepspeed.comm as ds_comm

    backend = ds_comm.comm.cdb
    all_gather, all_reduce = backend.all_gather_function, backend.all_reduce

    def counted_all_gather(*args, **kwargs):
        count[0] += 1
        return all_gather(*args, **kwargs)

    def counted_all_reduce(tensor, op=None, group=None, async_op=False):
        count[0] += bool(async_op)
        return all_reduce(tensor, op, group, async_op)

    backend.all_gather_function, backend.all_reduce = counted_all_gather, counted_all_reduce
    try:
        yield count
    finally:
        backend.all_gather_function = all_gather
        del backend.all_reduce  # the class's method again


def reduce_max_diff(runtime) -> float:
    """Largest difference, over all ranks, between zero3.py's all-reduce reduction and
    DeepSpeed's reduce_scatter_coalesced: a shuffled bucket of views (reduced in place),
    a tensor whose size the world does not divide, and tensors in separate storages."""
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

    from rlhf_dist.distributed.zero3 import _reduce_scatter_coalesced_by_all_reduce as ours

    g = torch.Generator().manual_seed(runtime.rank)  # each rank holds other gradients
    bucket = torch.randn(4 + 7 + 64, generator=g)
    views = [bucket[11:].view(8, 8), bucket[:4], bucket[4:11]]  # not in bucket order
    cases = [views, [torch.randn(7, generator=g)], [torch.randn(5, generator=g), torch.randn(3, 2)]]
    worst = 0.0
    for tensors in cases:
        theirs = reduce_scatter_coalesced([t.clone() for t in tensors])
        mine = ours(tensors)  # in place where the tensors tile one buffer
        assert [m.shape for m in mine] == [t.shape for t in theirs]
        worst = max(
            [worst] + [float((m - t).abs().max()) for m, t in zip(mine, theirs) if t.numel()]
        )
    return float(runtime.all_max(torch.tensor(worst)))


@contextlib.contextmanager
def shared_packed_rows(on: bool):
    """With `on`: packed rows of twice the padded width for the duration (the probe's rows
    are close in length); yields [padded rows, packed rows] summed over the forwards."""
    counts, original = [0, 0], engine_packing.packed_layout

    def wider(attention_mask, capacity):
        layout = original(attention_mask, 2 * capacity)
        counts[0] += attention_mask.shape[0]
        counts[1] += layout[0].shape[0]
        return layout

    if on:
        engine_packing.packed_layout = wider
    try:
        yield counts
    finally:
        engine_packing.packed_layout = original


def main():
    policy, reward, out = sys.argv[1:4]
    uneven = [a.split("=", 1)[1] for a in sys.argv[4:] if a.startswith("--uneven-generation=")]
    quiet_transformers()
    runtime = Runtime(seed=0, num_threads=1)
    result = {"gradients": {}, "checkpoint_optimizer": {}, "zero3": {}}
    teacher = ""
    if any(":--distill=" in a for a in sys.argv[4:]):
        teacher = f"{out}.teacher"
        if runtime.is_main:
            with runtime.local_loading():  # one rank's load: outside ZeRO-3's collective init
                write_teacher(policy, out)
        runtime.barrier()
    runtimes = {1: runtime}
    for variant in (a for a in sys.argv[4:] if not a.startswith("--")):
        name, micro, *flags = variant.split(":")
        cfg = variant_config(policy, reward, int(micro), flags, teacher)
        n = cfg.distributed.sequence_parallel_size
        if n not in runtimes:  # the ranks' sequence-parallel groups, made once
            runtimes[n] = Runtime(seed=0, num_threads=1, sequence_parallel_size=n)
        with shared_packed_rows("--packed" in flags) as rows:
            grads, optimizer, facts = probe(
                runtimes[n], cfg, "--whole-weights" in flags, "--overlong-mask" in flags
            )
        if "--packed" in flags:
            result.setdefault("packed_rows", {})[name] = rows
        result["gradients"][name] = grads
        result["checkpoint_optimizer"][name] = optimizer
        if "micro_counts" in facts:
            result.setdefault("micro_counts", {})[name] = facts.pop("micro_counts")
        if "cov_chosen" in facts:
            result.setdefault("cov_chosen", {})[name] = facts.pop("cov_chosen")
        result["zero3"][name] = facts
    if "--check-reduce" in sys.argv:
        result["reduce_max_diff"] = reduce_max_diff(runtime)
    if uneven:
        from uneven_generation import uneven_rollout_and_step  # this script's directory

        result["uneven_widths"] = {
            gather: uneven_rollout_and_step(runtime, policy, reward, uneven[0], gather)
            for gather in (True, False)
        }
    if runtime.is_main:
        torch.save(result, out)
    runtime.barrier()
    for spec in (a.split("=", 1)[1] for a in sys.argv[4:] if a.startswith("--sequence-par")):
        from sp_probe import run  # this script's directory: the same launch, no second one

        sp_out, _, length = spec.rpartition(":")
        run(sp_out, int(length))


if __name__ == "__main__":
    main()
    sys.exit(end_process(0))  # gloo and interpreter exit: distributed/process_exit.py
