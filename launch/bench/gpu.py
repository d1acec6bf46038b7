"""One PPO iteration's phases on a GPU, with a ~0.5B-parameter random-init Llama in bf16.

Usage: python launch/bench/gpu.py sync   (the weight sync's CUDA path: below)
       python launch/bench/gpu.py [--preset auto|gpu|cpu] [--batch 32] [--prompt-len N]
                                  [--response-len N] [--repeats 3] [--json OUT]

Times the three phases of `rlhf-dist ppo` with the project's own pieces
(rlhf_dist.engine.decode.generate, rlhf_dist.engine.forward.token_logprobs / ActorCritic / ValueModel /
sequence_scores, rlhf_dist.trainers.ppo.update.micro_batch_loss, rlhf_dist.algo rewards and GAE):
  generation  sampling `response-len` tokens for `batch` prompts (KV cache);
  scoring     actor+critic (old log-probs, values), reference, reward model forwards;
  update      4 epochs x 4 minibatches: forward + backward of actor and critic, AdamW step;
and prints tokens/s for each and the update's MFU (counted FLOPs / time / peak FLOP/s).

Without CUDA it runs the same code on CPU with a small fp32 config (hidden 128, 2 layers,
vocab 1000) so that the script itself stays tested on machines without a GPU; its MFU is
then relative to a measured fp32 matmul rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from rlhf_dist.algo.advantages import gae
from rlhf_dist.algo.masking import masked_mean, masked_var, whiten_with
from rlhf_dist.algo.rewards import shape_rewards
from rlhf_dist.config import GenerationConfig
from rlhf_dist.distributed.process_exit import end_process
from rlhf_dist.engine.decode import generate
from rlhf_dist.engine.forward import token_logprobs
from rlhf_dist.models import ActorCritic, ValueModel, sequence_scores
from rlhf_dist.rollout import RolloutBatch
from rlhf_dist.rollout.batch import sequence_last_index
from rlhf_dist.stats import StatSums
from rlhf_dist.trainers.ppo.update import UpdateKnobs, micro_batch_loss

PPO_EPOCHS = 4
MINIBATCHES = 4
TEMPERATURE = 0.7
# ppo.clip_eps, value_clip_eps, vf_coef and the actor/critic gradient-norm limits.
KNOBS = UpdateKnobs(
    TEMPERATURE, 0.2, None, None, 0.2, 0.1, 0.0, 0.0, "k1", "token_mean", (1.0, 1.0)
)
H100_BF16_DENSE = 989e12  # also the H200's figure: same Hopper SMs, only memory differs

PRESETS = {
    # ~0.5B: 24 x 16.8M (attention 4M + MLP 12.6M) + 2 x 32.8M embeddings = 470M per model.
    "gpu": dict(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=4096,
        vocab_size=32000,
        dtype=torch.bfloat16,
        prompt_len=128,
        response_len=128,
    ),
    "cpu": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=512,
        vocab_size=1000,
        dtype=torch.float32,
        prompt_len=16,
        response_len=32,
    ),
}
PAD, EOS, BOS = 0, 1, 2


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(device: torch.device, into: list[float]):
    """Wall-clock seconds of the block, after the device finished its queued work."""
    sync(device)
    start = time.perf_counter()
    yield
    sync(device)
    into.append(time.perf_counter() - start)


def llama_config(p: dict, num_labels: int | None = None) -> LlamaConfig:
    config = LlamaConfig(
        hidden_size=p["hidden_size"],
        num_hidden_layers=p["num_hidden_layers"],
        num_attention_heads=p["num_attention_heads"],
        num_key_value_heads=p["num_key_value_heads"],
        intermediate_size=p["intermediate_size"],
        vocab_size=p["vocab_size"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
    )
    if num_labels is not None:
        config.num_labels = num_labels
    return config


def build_models(p: dict, device: torch.device):
    """Random-init actor, reference (a copy), critic and reward model (same init, as
    ppo.critic_init=reward), all in the preset's dtype on `device`."""
    torch.manual_seed(0)
    dtype = p["dtype"]
    actor = LlamaForCausalLM(llama_config(p)).to(device, dtype)
    reference = LlamaForCausalLM(llama_config(p)).to(device, dtype).eval()
    reference.load_state_dict(actor.state_dict())
    rm_cls = LlamaForSequenceClassification(llama_config(p, num_labels=1)).to(device, dtype)
    critic_cls = LlamaForSequenceClassification(llama_config(p, num_labels=1)).to(device, dtype)
    critic_cls.load_state_dict(rm_cls.state_dict())
    reward = ValueModel(rm_cls).eval()
    for frozen in (reference, reward):
        frozen.requires_grad_(False)
    return ActorCritic(actor, ValueModel(critic_cls)), reference, reward


def matmul_params(p: dict) -> tuple[int, int]:
    """(per-token matmul weights of a Llama body, LM-head weights)."""
    d, f, n = p["hidden_size"], p["intermediate_size"], p["num_hidden_layers"]
    kv = d // p["num_attention_heads"] * p["num_key_value_heads"]
    return n * (2 * d * d + 2 * d * kv + 3 * d * f), d * p["vocab_size"]


def forward_flops(p: dict, length: int, head_tokens: int, head_width: int | None = None) -> float:
    """FLOPs of one causal forward of one sequence: 2 per weight per token, the LM head on
    `head_tokens` positions, attention 4*d per (query, key) pair, length^2/2 pairs."""
    body, head = matmul_params(p)
    if head_width is not None:
        head = p["hidden_size"] * head_width
    attention = 4 * p["hidden_size"] * p["num_hidden_layers"] * length * length / 2
    return 2 * body * length + 2 * head * head_tokens + attention


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Measured matmul FLOP/s of a large square product in `dtype` on `device`."""
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times: list[float] = []
    for _ in range(10):
        with timed(device, times):
            a @ b
    return 2 * n**3 / min(times)


def update_pass(model, optimizer, batch: RolloutBatch, adv, returns, idx: torch.Tensor) -> None:
    """One optimizer step on a minibatch with the trainer's own ppo.micro_batch_loss (one
    micro-batch; plain backward and clipping, as one process without DeepSpeed does)."""
    mb = batch.select(idx)
    loss_sum, _ = micro_batch_loss(model, mb, adv[idx], returns[idx], KNOBS, StatSums())
    (loss_sum / mb.response_mask.sum()).backward()
    torch.nn.utils.clip_grad_norm_(model.actor.parameters(), KNOBS.max_grad_norms[0])
    torch.nn.utils.clip_grad_norm_(model.critic.parameters(), KNOBS.max_grad_norms[1])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def iteration(p, model, reference, reward, optimizer, args, device, times: dict) -> None:
    B, P, T = args.batch, args.prompt_len, args.response_len
    g = torch.Generator(device="cpu").manual_seed(len(times["generate"]))
    prompt_ids = torch.randint(3, p["vocab_size"], (B, P), generator=g).to(device)
    prompt_mask = torch.ones_like(prompt_ids)
    gen_cfg = GenerationConfig(
        max_new_tokens=T, min_new_tokens=T, temperature=TEMPERATURE, top_k=0, top_p=1.0
    )
    tok = types.SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)

    model.eval()
    with timed(device, times["generate"]):
        resp = generate(model.actor, prompt_ids, prompt_mask, gen_cfg, tok)
    resp = resp[:, :T]
    mask = torch.ones_like(resp, dtype=torch.bool)
    ids = torch.cat([prompt_ids, resp], dim=1)
    attn = torch.cat([prompt_mask, mask.long()], dim=1)
    with timed(device, times["score"]), torch.no_grad():
        old_logprobs, _, old_values = model(ids, attn, mask, TEMPERATURE)
        ref_logprobs, _ = token_logprobs(reference, ids, attn, mask, TEMPERATURE)
        scores = sequence_scores(reward, ids, attn, sequence_last_index(P, mask))
    rewards, _ = shape_rewards(scores.float(), old_logprobs, ref_logprobs.float(), mask, 0.05)
    adv, returns = gae(rewards, old_values.float(), mask, 1.0, 0.95)
    adv = whiten_with(adv, mask, masked_mean(adv, mask), masked_var(adv, mask))
    batch = RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=resp,
        response_mask=mask,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs.float(),
        old_values=old_values.float(),
        scores=scores.float(),
        raw_scores=scores.float(),
        finished=torch.ones(B, dtype=torch.bool, device=device),
        entropy=torch.zeros_like(old_logprobs),  # not read by the update
    )
    model.train()
    with timed(device, times["update"]):
        for _ in range(PPO_EPOCHS):
            order = torch.randperm(B, device=device)
            for idx in order.chunk(MINIBATCHES):
                update_pass(model, optimizer, batch, adv, returns, idx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="auto", choices=("auto", "gpu", "cpu"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--response-len", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="timed iterations after 1 warm-up")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    preset = args.preset if args.preset != "auto" else ("gpu" if cuda else "cpu")
    device = torch.device("cuda" if cuda and preset == "gpu" else "cpu")
    p = PRESETS[preset]
    args.prompt_len = args.prompt_len or p["prompt_len"]
    args.response_len = args.response_len or p["response_len"]
    B, P, T = args.batch, args.prompt_len, args.response_len
    L = P + T

    model, reference, reward = build_models(p, device)
    # Pure-dtype AdamW (no fp32 master weights): measures the loop, not mixed precision.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, eps=1e-5)
    n_params = sum(x.numel() for x in model.actor.parameters())
    times: dict[str, list[float]] = {"generate": [], "score": [], "update": []}
    for _ in range(1 + args.repeats):
        iteration(p, model, reference, reward, optimizer, args, device, times)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}  # first = warm-up

    # Counted FLOPs (same rules as harness.py): the actor needs logits only at the
    # T response positions; critic/reward heads have one output.
    actor_fwd = forward_flops(p, L, T)
    critic_fwd = forward_flops(p, L, L, head_width=1)
    update_flops = PPO_EPOCHS * B * 3 * (actor_fwd + critic_fwd)
    peak_measured = peak_flops(device, p["dtype"])
    peak = H100_BF16_DENSE if device.type == "cuda" else peak_measured
    rows = {
        "generate": (B * T / med["generate"], "response tokens/s"),
        "score": (4 * B * L / med["score"], "tokens/s (4 models x prompt+response)"),
        "update": (
            PPO_EPOCHS * 2 * B * L / med["update"],
            "tokens/s (epochs x actor+critic x prompt+response)",
        ),
    }
    mfu = update_flops / med["update"] / peak
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"== one PPO iteration on {name}: {preset} preset, {n_params / 1e6:.1f}M params per model, "
        f"{str(p['dtype']).removeprefix('torch.')}, batch {B}, prompt {P} + response {T} tokens, "
        f"{PPO_EPOCHS} epochs x {MINIBATCHES} minibatches, median of {args.repeats}"
    )
    print(f"{'phase':10s} {'seconds':>9s} {'tokens/s':>12s}  what")
    for k, (rate, what) in rows.items():
        print(f"{k:10s} {med[k]:9.3f} {rate:12.1f}  {what}")
    print(f"{'total':10s} {sum(med.values()):9.3f}")
    print(
        f"update MFU {mfu:.1%}: {update_flops:.3g} FLOPs in {med['update']:.3f} s = "
        f"{update_flops / med['update'] / 1e12:.3g} TFLOP/s over a peak of {peak / 1e12:.3g} "
        f"TFLOP/s ({'H100/H200 bf16 dense spec' if device.type == 'cuda' else 'measured'}); "
        f"measured matmul {peak_measured / 1e12:.3g} TFLOP/s"
    )
    if args.json:
        out = {
            "device": name,
            "preset": preset,
            "params_per_model": n_params,
            "seconds": med,
            "tokens_per_s": {k: v[0] for k, v in rows.items()},
            "update_mfu": mfu,
            "peak_flops": peak,
            "measured_matmul_flops": peak_measured,
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")


# ==============================================================================================
# sync: What one GPU can run of the weight sync's CUDA path (distributed/weight_sync.py;
# docs/serving.md, "Weight sync"). NCCL refuses two ranks on one device, so the group of
# trainer rank 0 and a server waits for a machine with two GPUs; this checks the rest:
#
# 1. the choice: `sync_backend` picks NCCL for an actor on the GPU when every server
#    offers it, gloo when one does not;
# 2. the buckets of a bf16 Llama on the GPU (`weight_buckets`, 16 MiB): in order, every
#    weight once, each bucket within the bound or a single weight;
# 3. an NCCL group of one rank (world 1: the store, the communicator made at the join,
#    each bucket placed on the group's device without a copy and broadcast with the
#    timeout), the walk's seconds and its GPU memory growth (`MemoryGrowth`: at most about
#    one bucket, as the bound promises);
# 4. a gloo group of one rank on the same machine (a server without a GPU): the bucket is
#    copied to the CPU before it is sent.
#
# Its last line: `sync_cuda: ok buckets=N largest_mib=X walk_s=Y growth_mib=Z`, or
# `sync_cuda: skipped (...)` without a GPU or NCCL.
#
# Usage: python launch/bench/gpu.py sync

SYNC_BUCKET = 16 * 2**20


def sync_main() -> None:
    """The weight sync's CUDA path on one GPU (module comment above)."""
    from rlhf_dist.distributed.weight_sync import (
        MemoryGrowth,
        SyncGroup,
        free_port,
        local_backends,
        sync_backend,
        weight_buckets,
    )

    if "nccl" not in local_backends():
        print("sync_cuda: skipped (no GPU or no NCCL in this torch)")
        return
    gpu = torch.device("cuda", torch.cuda.current_device())
    assert sync_backend(gpu, [["gloo", "nccl"]]) == "nccl"
    assert sync_backend(gpu, [["gloo", "nccl"], ["gloo"]]) == "gloo"
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
    model = LlamaForCausalLM(cfg).to(gpu, torch.bfloat16)
    named = list(model.named_parameters())
    buckets = list(weight_buckets(named, SYNC_BUCKET))
    sizes = [sum(p.numel() * p.element_size() for _, p in b) for b in buckets]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    assert all(s <= SYNC_BUCKET or len(b) == 1 for s, b in zip(sizes, buckets))

    group = SyncGroup("127.0.0.1", free_port(), 0, 1, timeout_s=60, backend="nccl")
    assert group.device == gpu
    torch.cuda.synchronize()
    start = time.perf_counter()
    with MemoryGrowth(gpu) as grown:
        for bucket in buckets:
            for _, p in bucket:
                sent = group.placed(p)
                assert sent.data_ptr() == p.data_ptr()  # on the GPU already: no copy
                group.broadcast(sent)
    walk_s = time.perf_counter() - start

    cpu_group = SyncGroup("127.0.0.1", free_port(), 0, 1, timeout_s=60)
    _, first = buckets[0][0]
    on_cpu = cpu_group.placed(first)
    assert on_cpu.device.type == "cpu" and torch.equal(cpu_group.broadcast(on_cpu), first.cpu())
    print(
        f"sync_cuda: ok buckets={len(buckets)} largest_mib={max(sizes) / 2**20:.1f} "
        f"walk_s={walk_s:.3f} growth_mib={grown.peak_bytes / 2**20:.1f}"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["sync"]:
        sync_main()
        # a process that made a gloo group leaves by os._exit (process_exit.py)
        sys.exit(end_process(0))
    main()
