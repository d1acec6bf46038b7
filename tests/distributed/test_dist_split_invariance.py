"""One optimizer step's gradient does not depend on how the minibatch is split.

docs/architecture.md section 4: token sums are divided by the token count of the WHOLE global
minibatch, so 1 rank x 1 micro-batch, 1 rank x 4 micro-batches and 2 ranks (ZeRO-3)
x 2 micro-batches must give the same gradient, even with ragged response lengths that
put different token counts on each rank and micro-batch. Splitting each sequence's columns
over ranks (sequence parallelism) must give the same loss and gradient too: the DDP
launch runs scripts/sp_probe.py after its own variant.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO, _env, free_port, launch_args, run_launch

PROBE = str(REPO / "tests" / "distributed" / "scripts" / "grad_probe.py")


ADAMW = "torch.optim.adamw.AdamW"

# Loss-aggregation flags of the probe (scripts/grad_probe.py) and the name of the run
# with the same flags but token_mean aggregation, which must give another gradient.
AGGREGATIONS = {
    "seq_mean_token_sum": (("--aggregation=seq_mean_token_sum",), "token_mean"),
    "seq_mean_token_mean-critic_free": (
        ("--aggregation=seq_mean_token_mean", "--critic-free"),
        "token_mean-critic_free",
    ),
    # GSPO's sequence ratio with its paper's aggregation (and a critic), and CISPO with
    # every critic-free term and truncated rows masked out (docs/agents.md, "Objectives")
    "gspo": (("--ratio-level=sequence", "--aggregation=seq_mean_token_mean"), "token_mean"),
    "cispo-overlong_mask": (
        ("--policy-loss=cispo", "--critic-free", "--overlong-mask"),
        "token_mean-critic_free",
    ),
}


# ppo.cov_control (trainers/ppo/entropy.py) on top of every critic-free term (the entropy
# bonus included): the tokens are chosen over all ranks before the backward.
COV_CONTROLS = {
    method: ("--critic-free", f"--cov-control={method}") for method in ("clip_cov", "kl_cov")
}


def variant(name: str, micro: int, *flags: str) -> str:
    return ":".join([name, str(micro), *flags])


def probe_single(assets, out, *variants: str) -> dict:
    args = [sys.executable, PROBE, assets["policy"], assets["reward"], str(out), *variants]
    proc = subprocess.run(args, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def probe_two_ranks(assets, out, config: str, *variants: str, cwd=REPO, timeout=180) -> dict:
    cmd = [PROBE, assets["policy"], assets["reward"], str(out), *variants]
    # Several variants share this launch: 3 minutes before it counts as a hang.
    run_launch(launch_args(config, free_port(), *cmd), timeout=timeout, cwd=cwd)
    return torch.load(out)


@pytest.fixture(scope="module")
def one_rank(assets, tmp_path_factory):
    """Every one-process gradient the tests compare against, from ONE probe process: each
    aggregation as 1 rank x 1 micro-batch of 8 ("NAME") and x 4 micro-batches of 2
    ("NAME/1x4"), and token_mean with the critic-free terms."""
    variants = [variant("token_mean", 8), variant("token_mean/1x4", 2)]
    variants.append(variant("token_mean-critic_free", 8, "--critic-free"))
    # ppo.micro_batch_tokens=30: rows sorted by length into micro-batches of 1-3 rows
    variants.append(variant("token_mean/budget", 8, "--tokens=30"))
    # perf.packed_sequences: by 4 micro-batches of 2, and by the token budget
    variants.append(variant("token_mean/packed-1x4", 2, "--packed"))
    variants.append(variant("token_mean/packed-budget", 8, "--tokens=30", "--packed"))
    for name, (flags, _) in AGGREGATIONS.items():
        variants += [variant(name, 8, *flags), variant(f"{name}/1x4", 2, *flags)]
    for name, flags in COV_CONTROLS.items():
        variants += [variant(name, 8, *flags), variant(f"{name}/1x4", 2, *flags)]
    # on-policy distillation's GJSD to a teacher (docs/distill.md), a loss term of its own
    variants += [variant("gjsd", 8, "--distill=gjsd"), variant("gjsd/1x4", 2, "--distill=gjsd")]
    variants.append(variant("lora-critic_free", 8, "--critic-free", "--lora"))
    return probe_single(assets, tmp_path_factory.mktemp("one_rank") / "1.pt", *variants)


@pytest.fixture(scope="module")
def zero3(assets, tmp_path_factory):
    """Every 2 ranks x 2 micro-batches ZeRO-3 gradient, from ONE launch: each aggregation
    with ZeRO-3's per-layer fetching, token_mean by a token budget that gives the ranks
    different micro-batch counts, token_mean again with gradient checkpointing, and
    with the weights gathered whole (with and without checkpointing); then, in the same
    launch, ranks generating different lengths (scripts/uneven_generation.py) and the
    all-reduce gradient reduction against DeepSpeed's reduce-scatter."""
    variants = [variant("token_mean", 2)]
    variants += [variant(name, 2, *flags) for name, (flags, _) in AGGREGATIONS.items()]
    variants += [variant(name, 2, *flags) for name, flags in COV_CONTROLS.items()]
    # A token budget of 16 cells: rank 0's share needs 3 micro-batches, rank 1's 4.
    variants.append(variant("budget", 2, "--tokens=16"))
    variants.append(variant("checkpointing", 2, "--gradient-checkpointing"))
    variants.append(variant("packed-checkpointing", 2, "--packed", "--gradient-checkpointing"))
    # The trainers' path: weights gathered whole for the step (zero3.py), with and
    # without recomputation.
    variants.append(variant("whole", 2, "--whole-weights"))
    variants.append(
        variant("whole-checkpointing", 2, "--whole-weights", "--gradient-checkpointing")
    )
    # GJSD with the teacher partitioned: its forward per micro-batch a collective, its head
    # gathered once per micro-batch (zero3.whole_tensors) for every chunk of both passes
    variants.append(variant("gjsd", 2, "--distill=gjsd", "--teacher-partition"))
    # Ulysses sequence parallelism (sp=2: both ranks run every micro-batch, half its columns
    # each) under ZeRO-3, with recomputation, and with LoRA adapters (issue 35)
    sp = ("--critic-free", "--sequence-parallel")
    variants.append(variant("sp-checkpointing", 2, *sp, "--gradient-checkpointing"))
    variants.append(variant("sp-lora-checkpointing", 2, *sp, "--lora", "--gradient-checkpointing"))
    variants += [f"--uneven-generation={assets['files'].prompts}", "--check-reduce"]
    out = tmp_path_factory.mktemp("zero3") / "2x2.pt"
    return probe_two_ranks(assets, out, "cpu_zero3.yaml", *variants)


@pytest.fixture(scope="module")
def ddp(assets, tmp_path_factory) -> dict:
    """ONE 2-rank DDP launch: token_mean by 2 micro-batches ("probe"), then in the same
    process group every case of scripts/sp_probe.py at 2,048 tokens ("sp"; the tests of
    distributed.sequence_parallel_size below)."""
    root = tmp_path_factory.mktemp("ddp")
    sp = f"--sequence-parallel-probe={root / 'sp.pt'}:2048"
    probe = probe_two_ranks(
        assets, root / "ddp.pt", "cpu_ddp.yaml", variant("token_mean", 2), sp, timeout=300
    )
    return {"probe": probe, "sp": torch.load(root / "sp.pt")}


def assert_same_gradients(reference: dict, other: dict, tolerance: float, what: str) -> None:
    assert reference.keys() == other.keys()
    for name, g in reference.items():
        scale = g.abs().max().clamp(min=1e-6)
        assert (other[name] - g).abs().max() / scale < tolerance, f"{what} differs at {name}"


def test_gradient_same_for_1x1_1x4_2x2_zero3_and_2x2_ddp(one_rank, zero3, ddp):
    ddp = ddp["probe"]
    # The checkpoint code reads the Adam state of the torch AdamW on every backend, not
    # Accelerate's wrapper nor DeepSpeed's ZeRO optimizer around it.
    for probe in (one_rank, zero3, ddp):
        assert set(probe["checkpoint_optimizer"].values()) == {ADAMW}
    grads = one_rank["gradients"]["token_mean"]
    assert any(g.abs().sum() > 0 for g in grads.values())
    assert_same_gradients(grads, one_rank["gradients"]["token_mean/1x4"], 1e-5, "1x4")
    assert_same_gradients(grads, zero3["gradients"]["token_mean"], 1e-4, "2x2 ZeRO-3")
    assert_same_gradients(grads, ddp["gradients"]["token_mean"], 1e-4, "2x2 DDP")


@pytest.mark.parametrize("aggregation", list(AGGREGATIONS))
def test_gradient_split_invariant_for_each_loss_aggregation(one_rank, zero3, aggregation):
    """Sequence-level aggregations divide by the global SEQUENCE count; the critic-free
    case adds every other loss term (KL as k3 loss, entropy bonus, clip-higher, dual clip)."""
    flags, token_mean_name = AGGREGATIONS[aggregation]
    grads = one_rank["gradients"][aggregation]
    assert any(g.abs().sum() > 0 for g in grads.values())
    assert any(k.startswith("critic.") for k in grads) == ("--critic-free" not in flags)
    token_mean = one_rank["gradients"][token_mean_name]
    assert any((token_mean[k] - g).abs().max() > 1e-4 * g.abs().max() for k, g in grads.items())
    assert_same_gradients(grads, one_rank["gradients"][f"{aggregation}/1x4"], 1e-5, "1x4")
    assert_same_gradients(grads, zero3["gradients"][aggregation], 1e-4, "2x2 ZeRO-3")


@pytest.mark.parametrize("method", list(COV_CONTROLS))
def test_cov_control_chooses_the_same_tokens_and_gradient_on_every_split(one_rank, zero3, method):
    """Clip-Cov / KL-Cov: the same 3 of the 35 tokens chosen on 1 rank and on 2 ZeRO-3
    ranks (each rank choosing from its own share with global means and top-k), and the
    same gradient for 1 x 1, 1 x 4 and 2 x 2; a gradient the choice changed."""
    chosen = one_rank["cov_chosen"][method]
    assert len(chosen) == 3 and chosen == one_rank["cov_chosen"][f"{method}/1x4"]
    assert zero3["cov_chosen"][method] == chosen
    grads = one_rank["gradients"][method]
    plain = one_rank["gradients"]["token_mean-critic_free"]
    assert any((plain[k] - g).abs().max() > 1e-4 * g.abs().max() for k, g in grads.items())
    assert_same_gradients(grads, one_rank["gradients"][f"{method}/1x4"], 1e-5, "1x4")
    assert_same_gradients(grads, zero3["gradients"][method], 1e-4, "2x2 ZeRO-3")


def test_distillation_gjsd_is_split_invariant_with_a_partitioned_teacher(one_rank, zero3):
    """ppo.distill_loss=gjsd: GJSD to the teacher over the whole vocabulary, chunked, in
    the loss: the same gradient for 1 x 1, 1 x 4 and 2 ZeRO-3 ranks x 2 with the teacher
    partitioned (a hang would time out the zero3 launch), and not the gradient without it."""
    grads = one_rank["gradients"]["gjsd"]
    token_mean = one_rank["gradients"]["token_mean"]
    assert any((token_mean[k] - g).abs().max() > 1e-3 * g.abs().max() for k, g in grads.items())
    assert_same_gradients(grads, one_rank["gradients"]["gjsd/1x4"], 1e-5, "1x4")
    assert_same_gradients(grads, zero3["gradients"]["gjsd"], 1e-4, "2x2 ZeRO-3")
    assert one_rank["zero3"]["gjsd"]["teacher_partitioned"] is False
    assert zero3["zero3"]["gjsd"]["teacher_partitioned"] is True


def test_token_budget_micro_batches_give_the_same_gradient(one_rank, zero3):
    """ppo.micro_batch_tokens (update_micro_batches): rows sorted by length and cut by the
    budget, the same gradient as one micro-batch of 8 on 1 rank and on 2 ZeRO-3 ranks,
    where rank 0's budget alone needs 3 micro-batches and rank 1's 4: rank 0 runs 4 too
    (every pass is a collective; a hang would time out the zero3 launch)."""
    grads = one_rank["gradients"]["token_mean"]
    assert_same_gradients(grads, one_rank["gradients"]["token_mean/budget"], 1e-6, "1 budget")
    assert one_rank["micro_counts"]["token_mean/budget"] == {"greedy": [4], "passes": [4]}
    assert_same_gradients(grads, zero3["gradients"]["budget"], 1e-4, "2 ranks budget")
    layered = zero3["gradients"]["token_mean"]
    assert_same_gradients(layered, zero3["gradients"]["budget"], 1e-6, "ZeRO-3 budget")
    assert zero3["micro_counts"]["budget"] == {"greedy": [3, 4], "passes": [4, 4]}


def test_packed_sequences_give_the_same_gradient(one_rank, zero3):
    """perf.packed_sequences: actor, critic and reward forwards on packed rows, by 4
    micro-batches, by a token budget, and on 2 ZeRO-3 ranks with gradient checkpointing:
    the padded batch's gradient. Sequences share packed rows (the probe's are twice the
    padded width)."""
    for probe in (one_rank, zero3):
        for padded, packed in probe["packed_rows"].values():
            assert packed < padded, probe["packed_rows"]
    grads = one_rank["gradients"]["token_mean"]
    for name in ("token_mean/packed-1x4", "token_mean/packed-budget"):
        assert_same_gradients(grads, one_rank["gradients"][name], 1e-5, name)
    assert_same_gradients(grads, zero3["gradients"]["packed-checkpointing"], 1e-4, "ZeRO-3 packed")
    layered = zero3["gradients"]["checkpointing"]
    assert_same_gradients(layered, zero3["gradients"]["packed-checkpointing"], 1e-5, "packed")


def test_sequence_parallel_under_zero3_with_checkpointing_and_lora(one_rank, zero3):
    """distributed.sequence_parallel_size=2 on the 2 ZeRO-3 ranks (the critic-free update:
    both ranks run all 4 micro-batches, each half of every row's columns, ZeRO-3 fetching
    weights per layer), with gradient checkpointing, and with LoRA adapters on every
    linear: one process's gradient. LoRA's gradients are the adapters' only."""
    plain, lora = (one_rank["gradients"][k] for k in ("token_mean-critic_free", "lora-critic_free"))
    assert all("lora_" in name for name in lora) and not any("lora_" in n for n in plain)
    assert any(g.abs().max() > 0 for g in lora.values())
    assert_same_gradients(plain, zero3["gradients"]["sp-checkpointing"], 1e-4, "sp=2 ZeRO-3")
    assert_same_gradients(lora, zero3["gradients"]["sp-lora-checkpointing"], 1e-4, "sp=2 LoRA")


def test_gradient_and_checkpoint_optimizer_under_zero2(assets, one_rank, tmp_path):
    """Launched from another directory: cpu_zero2.yaml names its DeepSpeed file relative to
    the checkout (test_dist_launch_configs.py)."""
    variants = (variant("z2", 2),)
    zero2 = probe_two_ranks(
        assets, tmp_path / "zero2.pt", "cpu_zero2.yaml", *variants, cwd=tmp_path
    )
    assert zero2["checkpoint_optimizer"]["z2"] == ADAMW
    grads = one_rank["gradients"]["token_mean"]
    assert_same_gradients(grads, zero2["gradients"]["z2"], 1e-4, "2x2 ZeRO-2")


def test_gradient_split_invariant_under_fsdp2(assets, one_rank, tmp_path):
    """The same probe under FSDP2 (distributed/fsdp2.py), ONE launch: 2 ranks x 2
    micro-batches give one process's gradient with per-layer all-gathers, with gradient
    checkpointing, with the weights whole for the step, with LoRA adapters, and split by
    columns under distributed.sequence_parallel_size=2 (full and LoRA); ranks generating
    different lengths do not hang. The other split cases exercise the trainers'
    own arithmetic, the same under every engine: they run under ZeRO-3 only (suite budget,
    docs/distributed.md "Choosing the engine")."""
    variants = [variant("token_mean", 2), variant("checkpointing", 2, "--gradient-checkpointing")]
    variants += [variant("whole", 2, "--whole-weights")]
    variants += [variant("lora-critic_free", 2, "--critic-free", "--lora")]
    # Ulysses (engine/sequence_parallel.py) over FSDP2's per-layer all-gathers
    sp = ("--critic-free", "--sequence-parallel")
    variants += [variant("sp", 2, *sp), variant("sp-lora", 2, *sp, "--lora")]
    variants += [f"--uneven-generation={assets['files'].prompts}"]
    fsdp2 = probe_two_ranks(assets, tmp_path / "fsdp2.pt", "cpu_fsdp2.yaml", *variants)
    assert set(fsdp2["checkpoint_optimizer"].values()) == {ADAMW}
    for name in ("token_mean", "checkpointing", "whole"):
        grads = one_rank["gradients"]["token_mean"]
        assert_same_gradients(grads, fsdp2["gradients"][name], 1e-4, f"2x2 FSDP2 {name}")
    lora = one_rank["gradients"]["lora-critic_free"]
    assert_same_gradients(lora, fsdp2["gradients"]["lora-critic_free"], 1e-4, "FSDP2 LoRA")
    assert_same_gradients(lora, fsdp2["gradients"]["sp-lora"], 1e-4, "sp=2 FSDP2 LoRA")
    plain = one_rank["gradients"]["token_mean-critic_free"]
    assert_same_gradients(plain, fsdp2["gradients"]["sp"], 1e-4, "sp=2 FSDP2")
    assert fsdp2["uneven_widths"] == {True: [1, 16], False: [1, 16]}


def test_ranks_generating_different_lengths_do_not_hang(zero3):
    """Rank 0 stops after 1 token, rank 1 runs 16, then both score and step (collectives
    that need every rank); gathered and per-layer (synced) modes. A hang would time out
    the zero3 launch."""
    assert zero3["uneven_widths"] == {True: [1, 16], False: [1, 16]}


def test_gradient_checkpointing_under_zero3_gives_the_same_gradients(zero3):
    # Same backend and split, so the same reduction order: only recomputation differs.
    plain, ckpt = zero3["gradients"]["token_mean"], zero3["gradients"]["checkpointing"]
    assert any(g.abs().sum() > 0 for g in plain.values())
    assert_same_gradients(plain, ckpt, 1e-5, "ZeRO-3 + checkpointing")


def test_whole_weights_give_the_same_gradients_with_one_fetch_per_step(one_rank, zero3):
    """zero3.whole_weights (the trainers' steps under ZeRO-3): the same gradient as the
    per-layer fetching and as one process, from ONE weight-fetch collective for the step's
    two micro-batches, with ZeRO-3's hooks, F.linear and partitioning put back afterwards."""
    layered, facts = zero3["gradients"]["token_mean"], zero3["zero3"]
    for name in ("whole", "whole-checkpointing"):
        assert_same_gradients(layered, zero3["gradients"][name], 1e-6, f"ZeRO-3 {name}")
        assert_same_gradients(
            one_rank["gradients"]["token_mean"], zero3["gradients"][name], 1e-4, name
        )
        assert facts[name] == {"fetches": 1, "restored": True}
    # Per-layer fetching: every module of actor and critic, in forward and backward.
    assert facts["token_mean"]["restored"] and facts["token_mean"]["fetches"] > 10


def test_all_reduce_gradient_reduction_equals_deepspeeds_reduce_scatter(zero3):
    """Over gloo, ZeRO-3's reduce-scatter of each gradient bucket is one all-reduce in
    place (zero3.reduce_gradients_by_all_reduce): bitwise the same partitions on 2 ranks."""
    assert zero3["reduce_max_diff"] == 0.0


# distributed.sequence_parallel_size=2 on 2 CPU ranks (gloo, DDP) gives the loss and the
# gradient of sequence_parallel_size=1, to 1e-5, for one optimizer step of SFT, DPO, KTO and
# the GRPO update on 2K-token sequences, padded and packed, and the rollout's scoring gives
# the same log-probs and entropies (docs/distributed.md "Sequence parallelism").
# score: the rollout's scoring forwards; kto and score on padded rows only (sp_probe.py)
SP_CASES = [(case, "padded") for case in ("sft", "dpo", "kto", "grpo", "score")]
SP_CASES += [(case, "packed") for case in ("sft", "dpo", "grpo")]


@pytest.mark.parametrize(("case", "layout"), SP_CASES)
def test_sequence_parallel_gives_the_same_loss_and_gradient(ddp, case, layout):
    one, two = ddp["sp"][f"{case}/sp1/{layout}"], ddp["sp"][f"{case}/sp2/{layout}"]
    assert abs(two["loss"] - one["loss"]) <= 1e-5
    assert one["tensors"].keys() == two["tensors"].keys()
    for name, g in one["tensors"].items():
        assert g.abs().max() > 0, name  # every weight gets a gradient: a real comparison
        torch.testing.assert_close(two["tensors"][name], g, rtol=0, atol=1e-5, msg=name)
        # and relative to the tensor's own size (some gradients are ~1e-4 here)
        assert (two["tensors"][name] - g).norm() <= 1e-4 * g.norm(), name
