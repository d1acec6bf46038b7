"""Loss and gradient of one optimizer step of SFT, DPO, KTO and the GRPO update, with
distributed.sequence_parallel_size 1 and 2, padded and packed rows (perf.packed_sequences).

Usage (2 ranks): accelerate launch ... sp_probe.py OUT [LENGTH]
(or grad_probe.py ... --sequence-parallel-probe=OUT:LENGTH, after its own probes)
Every rank builds the same tiny Llama (4 heads; 2 key/value heads, 1 for GRPO) and the same global
batch of 4 sequences of up to LENGTH tokens (default 4096; ragged lengths, so ranks and
micro-batches hold different token counts), takes its share as the trainers do, and runs
the trainer's own step function (`sft_step`, `dpo_step`, `kto_step`, `minibatch_backward`) with one
sequence per micro-batch. With sp=2 the two ranks pool their micro-batches and split each
by columns. Rank 0 writes {"CASE/spN/packed|padded": {"loss": float, "tensors": {param:
full gradient}}} to OUT (the gradient after the backend's reduction over ranks, before
any optimizer step); CASE "score" is the rollout's scoring instead (no gradient): its
tensors are the old log-probs, entropies and reference log-probs of all rows.
"""

from __future__ import annotations

import math
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_dist.config import DPOConfig, KTOConfig, PerfConfig
from rlhf_dist.data.batching import BatchPlan
from rlhf_dist.data.rows import KTOExample, PreferencePair, SFTExample
from rlhf_dist.distributed import Runtime, seed_everything
from rlhf_dist.distributed.process_exit import end_process
from rlhf_dist.models import quiet_transformers
from rlhf_dist.models.value import ActorCritic
from rlhf_dist.rollout.batch import RolloutBatch
from rlhf_dist.rollout.collect import RolloutModels, _scoring_forwards
from rlhf_dist.trainers.common import make_optimizer
from rlhf_dist.trainers.dpo import dpo_step
from rlhf_dist.trainers.kto import kto_step
from rlhf_dist.trainers.ppo.update import UpdateKnobs, minibatch_backward
from rlhf_dist.trainers.sft import sft_step

V, PAD, GLOBAL = 64, 0, 4
# Cases run on padded rows only: KTO's forward is DPO's, scoring's the GRPO update's
# without gradients (the packed path is checked through those).
PADDED_ONLY = ("kto", "score")


def tiny_llama(length: int, kv_heads: int = 2) -> LlamaForCausalLM:
    seed_everything(0)
    config = LlamaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, intermediate_size=64, max_position_embeddings=length + 8,
        attention_dropout=0.0, pad_token_id=PAD, eos_token_id=1,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def sequences(length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sizes = [length, length // 2 + 17, length // 4, length // 8 + 3]  # one of LENGTH tokens
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in sizes]


def prepared(runtime: Runtime, net):
    optimizer = make_optimizer([(net.parameters(), DPOConfig().optim)])
    model, _ = runtime.prepare(net, optimizer, 1, 2, 1.0, "float32")
    model.train()
    return model


def full_grads(runtime: Runtime, model) -> dict:
    return {n: p.grad.detach().clone() for n, p in runtime.unwrap(model).named_parameters()}


def sft_case(runtime: Runtime, perf: PerfConfig, length: int) -> dict:
    model = prepared(runtime, tiny_llama(length))
    examples = [SFTExample(ids, len(ids) // 4) for ids in sequences(length, 1)]
    plan = BatchPlan(GLOBAL, runtime.world_size, 1)
    metrics, _ = sft_step(runtime, model, examples, plan, PAD, perf)
    return {"loss": metrics["sft/loss"], "tensors": full_grads(runtime, model)}


def dpo_case(runtime: Runtime, perf: PerfConfig, length: int) -> dict:
    model = prepared(runtime, tiny_llama(length))
    chosen, rejected = sequences(length // 2, 2), sequences(length // 2, 3)
    pairs = [
        PreferencePair(c[:64] + c, c[:64] + r[: len(r) - 40 * i], prompt_len=64)
        for i, (c, r) in enumerate(zip(chosen, rejected))
    ]
    lengths = torch.tensor([[len(p.chosen) - 64, len(p.rejected) - 64] for p in pairs])
    noise = torch.randn(GLOBAL, 2, generator=torch.Generator().manual_seed(4))
    ref_rows = -math.log(V) * lengths + 5 * noise  # near the random policy's log pi
    plan = BatchPlan(GLOBAL, runtime.world_size, 1)
    metrics, _ = dpo_step(runtime, model, None, pairs, ref_rows, plan, DPOConfig(), PAD, perf)
    return {"loss": metrics["dpo/loss"], "tensors": full_grads(runtime, model)}


def kto_case(runtime: Runtime, perf: PerfConfig, length: int) -> dict:
    model = prepared(runtime, tiny_llama(length))
    completions = sequences(length // 2, 6)
    examples = [
        KTOExample(c[:64], c[64:], i % 2 == 0, completions[(i + 1) % GLOBAL][64:])
        for i, c in enumerate(completions)
    ]
    # log pi_ref near the random policy's (log V nats a token), so the loss is not saturated
    lengths = torch.tensor([[len(ex.completion), len(ex.kl_completion)] for ex in examples])
    noise = torch.randn(GLOBAL, 2, generator=torch.Generator().manual_seed(7))
    ref_rows = -math.log(V) * lengths + 5 * noise
    plan = BatchPlan(GLOBAL, runtime.world_size, 1)
    metrics, _ = kto_step(runtime, model, None, examples, ref_rows, plan, KTOConfig(), PAD, perf)
    return {"loss": metrics["kto/loss"], "tensors": full_grads(runtime, model)}


def rollout(length: int) -> tuple[RolloutBatch, torch.Tensor]:
    """The global GRPO minibatch: left-padded prompts of up to 256 tokens, ragged responses
    ending in EOS, old and reference log-probs, advantages (B, T)."""
    g = torch.Generator().manual_seed(5)
    P, T = 256, length - 256
    prompt = torch.randint(2, V, (GLOBAL, P), generator=g)
    prompt_mask = torch.ones(GLOBAL, P, dtype=torch.long)
    for b, pad in enumerate((0, 50, 100, 7)):
        prompt_mask[b, :pad] = 0
        prompt[b, :pad] = PAD
    lengths = torch.tensor([T, T // 2, T // 4, T // 5])
    response_mask = torch.arange(T)[None, :] < lengths[:, None]
    response = torch.where(response_mask, torch.randint(2, V, (GLOBAL, T), generator=g), PAD)
    old = torch.where(response_mask, -torch.rand(GLOBAL, T, generator=g) * 5, 0.0)
    ref = torch.where(response_mask, old - 0.1 * torch.rand(GLOBAL, T, generator=g), 0.0)
    advantages = torch.randn(GLOBAL, 1, generator=g).expand(GLOBAL, T).clone()
    batch = RolloutBatch(
        prompt, prompt_mask, response, response_mask, old, ref, None,
        scores=torch.zeros(GLOBAL), raw_scores=torch.zeros(GLOBAL),
        finished=torch.ones(GLOBAL, dtype=torch.bool), entropy=torch.zeros(GLOBAL, T),
    )  # fmt: skip
    return batch, advantages


def grpo_case(runtime: Runtime, perf: PerfConfig, length: int) -> dict:
    # 1 KV head (the demo's MQA shape): copied per query head before the exchange
    model = prepared(runtime, ActorCritic(tiny_llama(length, kv_heads=1), None, perf))
    batch, advantages = rollout(length)
    per_rank = GLOBAL // runtime.world_size
    mine = slice(runtime.rank * per_rank, (runtime.rank + 1) * per_rank)
    knobs = UpdateKnobs(
        0.7, 0.2, 0.28, None, None, 0.0, 0.01, 0.05, "k3", "token_mean", (1.0,)
    )  # GRPO's critic-free terms: clip-higher, k3 KL as a loss term, an entropy bonus
    slices = [slice(i, i + 1) for i in range(per_rank)]
    step = minibatch_backward(
        runtime, model, batch.select(mine), advantages[mine], None, knobs, slices
    )
    return {
        "loss": step.stats.reduce(runtime)["policy/loss"],
        "tensors": full_grads(runtime, model),
    }


def score_case(runtime: Runtime, perf: PerfConfig, length: int) -> dict:
    """The rollout's scoring forwards (collect.py `_scoring_forwards`: the actor's old
    log-probs and entropies, the reference's log-probs) of this rank's rows in chunks of
    one, gathered from both ranks in row order."""
    actor = prepared(runtime, ActorCritic(tiny_llama(length, kv_heads=1), None, perf))
    reference = tiny_llama(length, kv_heads=1).eval()
    with torch.no_grad():  # another reference than the actor
        for p in reference.parameters():
            p.mul_(1.01)
    batch, _ = rollout(length)
    per_rank = GLOBAL // runtime.world_size
    mine = batch.select(slice(runtime.rank * per_rank, (runtime.rank + 1) * per_rank))
    sampled = {k: getattr(mine, k) for k in ("prompt_ids", "prompt_mask", "response_ids")}
    sampled["response_mask"] = mine.response_mask
    split = runtime.sequence_parallel_size > 1
    models = RolloutModels(
        actor, None, reference, None, perf=perf,
        pool=runtime.pool_micro_batches if split else None, split=runtime.sequence_parallel,
    )  # fmt: skip
    chunks = [slice(i, i + 1) for i in range(per_rank)]
    with torch.no_grad():
        parts = _scoring_forwards(models, sampled, chunks, 0.7, True)
    names = ("old_logprobs", "entropy", "ref_logprobs")
    mine_rows = {n: torch.cat([p[n] for p in parts]) for n in names}
    everything = runtime.gather_objects([mine_rows])
    tensors = {n: torch.cat([part[n] for part in everything]) for n in names}
    return {"loss": float(tensors["ref_logprobs"].sum()), "tensors": tensors}


def main():
    run(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4096)


def run(out: str, length: int) -> None:
    """Every case with sp 1 and 2 (Runtimes of its own), saved to `out` by rank 0; also
    called by grad_probe.py's --sequence-parallel-probe in its process group."""
    quiet_transformers()
    runtimes = {
        "sp1": Runtime(seed=0, num_threads=1),
        "sp2": Runtime(seed=0, num_threads=1, sequence_parallel_size=2),
    }
    result = {}
    cases = {"sft": sft_case, "dpo": dpo_case, "kto": kto_case, "grpo": grpo_case,
             "score": score_case}  # fmt: skip
    for packed in (False, True):
        perf = PerfConfig(packed_sequences=packed, logprob_chunk_tokens=1024)
        for name, runtime in runtimes.items():
            for case, fn in cases.items():
                if packed and case in PADDED_ONLY:
                    continue
                key = f"{case}/{name}/{'packed' if packed else 'padded'}"
                start = time.perf_counter()
                result[key] = fn(runtime, perf, length)
                result[key]["seconds"] = time.perf_counter() - start
    if runtimes["sp1"].is_main:
        torch.save(result, out)
    runtimes["sp1"].barrier()


if __name__ == "__main__":
    main()
    sys.exit(end_process(0))  # gloo and interpreter exit: distributed/process_exit.py
