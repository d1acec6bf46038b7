"""PPO-ptx: the "pretraining mix" of InstructGPT (Ouyang et al. 2022, eq. 2), here with SFT
rows (docs/architecture.md section 5, step 8).

objective(phi) = E[r(x, y) - beta log(pi / pi_SFT)] + gamma E_{x ~ D_ptx}[log pi(x)]

so each optimizer step's loss gains ppo.ptx_coef (gamma) x the token-mean NLL of one batch
of data.ptx rows (the trained tokens of an SFT file: responses, assistant turns). The rows
come from their own seed-determined stream (`batching.global_batches`, ppo.minibatch_size
rows per optimizer step), sharded across ranks like every global batch; a rank's share is
cut into as many micro-batches as the step's PPO micro-batches, and micro-batch i's NLL
SUM, divided by the token count of the WHOLE ptx batch (all ranks), is backwarded just
before PPO micro-batch i (its own forward and backward: ZeRO-3 wants each forward followed
by its backward, and the step's last, gradient-syncing backward stays PPO's, which reaches
every parameter). So the ptx gradient is that of the global token mean, whatever the split
(section 4, split invariance). The stream's position (batches drawn) is
checkpointed with the trainer state.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from rlhf_dist.config import Config
from rlhf_dist.data.batching import BatchPlan, global_batches
from rlhf_dist.data.rows import SFTExample, collate_sft, load_rows, sft_examples
from rlhf_dist.data.vision import Media
from rlhf_dist.distributed import Runtime
from rlhf_dist.errors import ConfigError
from rlhf_dist.stats import StatSums
from rlhf_dist.trainers.common import share_of_global_mean
from rlhf_dist.trainers.sft import token_nll_sum


def actor_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    predict_mask: torch.Tensor,
    *,
    media: Media | None = None,
) -> tuple[torch.Tensor, None]:
    """(log-probs (B, L-1), None) of the actor inside the prepared ActorCritic `model`,
    through its own forward (engine and DDP logic run), critic skipped, at temperature 1:
    the likelihood SFT trains, not the sampling distribution. `sft.sequence_nll`'s
    `logprobs_fn` (engine.forward.token_logprobs underneath); media: a vision batch's
    pixel inputs (data/vision.py) or None."""
    logprobs, _, _ = model(
        input_ids, attention_mask, predict_mask, with_critic=False, share_prompts=False,
        media=media,
    )  # fmt: skip
    return logprobs, None


class PtxStream:
    """The ptx rows of every optimizer step: `next_step` draws the next global batch.

    examples: SFTExample rows of data.ptx; plan: the global ptx batch (ppo.minibatch_size
    rows) over the world; position: global batches drawn so far (0, or a checkpoint's)."""

    def __init__(
        self,
        examples: list[SFTExample],
        plan: BatchPlan,
        coef: float,
        seed: int,
        pad_id: int,
        position: int = 0,
    ) -> None:
        self.examples, self.plan, self.coef, self.pad_id = examples, plan, coef, pad_id
        self.position = position
        batches = global_batches(len(examples), plan.global_size, seed, epochs=10**9)
        self._batches = itertools.islice(batches, position, None)

    def next_step(self, runtime: Runtime, parts: int) -> PtxStep:
        """This rank's share of the next global batch in `parts` micro-batches (as many as
        the step's PPO micro-batches, <= the share's rows), with the batch's global count
        of trained tokens (a collective)."""
        _, idx = next(self._batches)
        self.position += 1
        share = [self.examples[i] for i in idx[self.plan.rank_slice(runtime.rank)]]
        if not 1 <= parts <= len(share):
            raise ValueError(f"cannot cut {len(share)} ptx rows into {parts} micro-batches")
        chunks = [c.tolist() for c in torch.arange(len(share)).tensor_split(parts)]
        micro = []
        for chunk in chunks:
            batch = collate_sft([share[i] for i in chunk], self.pad_id)
            micro.append({k: v.to(runtime.device) for k, v in batch.items()})
        local = sum(b["loss_mask"].sum() for b in micro).float()
        return PtxStep(micro, runtime.all_sum(local).clamp(min=1.0), self.coef)


class PtxStep:
    """One optimizer step's ptx micro-batches and the global token count they share."""

    def __init__(self, micro: list[dict[str, torch.Tensor]], count: torch.Tensor, coef: float):
        self.micro, self.count, self.coef = micro, count, coef

    def loss(self, runtime: Runtime, model: nn.Module, i: int) -> tuple[torch.Tensor, StatSums]:
        """(coef x micro-batch i's share of the global token-mean NLL, the loss to backward
        (it adds to the step's gradient); its `policy/ptx_loss` sums, a token mean)."""
        nll_sum, tokens = token_nll_sum(model, self.micro[i], actor_logprobs)
        stats = StatSums()
        stats.add("policy/ptx_loss", nll_sum.detach(), tokens)
        return self.coef * share_of_global_mean(runtime, nll_sum, self.count), stats


def ptx_stream(
    cfg: Config, runtime: Runtime, tokenizer: Any, plan: BatchPlan, position: int = 0
) -> PtxStream | None:
    """The run's PtxStream (None with ppo.ptx_coef 0): data.ptx's SFT rows, at least one
    global batch of them, drawn from `position` on."""
    d, p = cfg.data, cfg.ppo
    if not p.ptx_coef:
        return None
    where = f"data.ptx {d.ptx!r}"
    examples, report = sft_examples(load_rows(d.ptx, "data.ptx"), tokenizer, d, where=where)
    runtime.print(report.summary("ptx data"))
    if len(examples) < plan.global_size:
        raise ConfigError(
            f"data.ptx: {len(examples)} usable rows, fewer than one ptx batch "
            f"(ppo.minibatch_size={plan.global_size}; {report.summary('ptx data')})"
        )
    return PtxStream(examples, plan, p.ptx_coef, cfg.run.seed, tokenizer.pad_token_id, position)
