"""The rollout batch (`RolloutBatch`, frozen: a step returns a new one) and what reads
it: the missing-EOS penalty, the last real token's position and the debug print.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, TypeAlias

import torch

from rlhf_dist.algo.masking import last_token_index
from rlhf_dist.data.rows import PromptSet, Text, left_pad
from rlhf_dist.data.vision import Media, RowMedia

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# rows of a batch: (k,) int64 indices or a boolean (B,) mask, or a slice
Rows: TypeAlias = torch.Tensor | slice


@dataclass(frozen=True)
class PromptBatch:
    """One rank's prompts for a rollout, B rows (a group's n samples are n rows).

    ids, mask: (B, P) left-padded token ids and their attention mask (1 on real tokens);
    texts: each prompt as its data row gave it (a text, or a list of messages); columns:
    each row's other columns (an answer, a task's metadata), which reward functions,
    judges and environments read beside the prompt (docs/rewards.md); index: each row's
    prompt as its position among data.train's usable prompts (`PromptSet`), which
    samples.jsonl logs as `prompt_index` (empty where the rows came from elsewhere)."""

    ids: torch.Tensor
    mask: torch.Tensor
    texts: list[Text]
    columns: list[dict] = field(default_factory=list)
    media: RowMedia | None = None  # a vision run's pixel inputs per row (data/vision.py)
    index: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.columns and len(self.columns) != len(self.texts):
            raise ValueError(f"{len(self.columns)} column rows for {len(self.texts)} prompts")
        if self.index and len(self.index) != len(self.texts):
            raise ValueError(f"{len(self.index)} prompt indices for {len(self.texts)} prompts")

    @classmethod
    def of(
        cls, prompts: PromptSet, rows: list[int], pad_id: int, device: torch.device | str
    ) -> PromptBatch:
        """The prompts `rows` (indices into `prompts`, repeats allowed) left-padded on
        `device`, with their texts and columns."""
        ids, mask = left_pad([prompts.ids[i] for i in rows], pad_id)
        columns = [prompts.columns[i] for i in rows] if prompts.columns else []
        texts = [prompts.texts[i] for i in rows]
        media = None
        if prompts.image_token_id is not None:  # a vision run
            images = tuple(prompts.images[i] for i in rows) if prompts.images else ()
            media = RowMedia(tuple(prompts.media[i] for i in rows), prompts.image_token_id, images)
        return cls(ids.to(device), mask.to(device), texts, columns, media, tuple(rows))

    def rows(self, s: slice) -> tuple[list[Text], list[dict]]:
        """(texts, columns) of the rows `s` (no columns: an empty dict per row)."""
        columns = self.columns[s] if self.columns else [{} for _ in self.texts[s]]
        return self.texts[s], columns


@dataclass(frozen=True)
class RolloutBatch:
    """One rank's rollout. Shapes: B sequences, P prompt tokens, T response tokens.
    Frozen: a step that changes a field returns a new batch (dataclasses.replace)."""

    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P) 1 on real prompt tokens
    response_ids: torch.Tensor  # (B, T) PAD after the first EOS
    response_mask: torch.Tensor  # (B, T) bool, True up to and including the first EOS
    # (B, T), 0 outside response_mask; None until the update's first forward gives them
    # (the skip of config/sizes.py::old_logprobs_from_update)
    old_logprobs: torch.Tensor | None
    # (B, T), 0 outside response_mask; None without a reference model until the update's
    # forward gives the old log-probs, which then stand in for it (KL 0)
    ref_logprobs: torch.Tensor | None
    old_values: torch.Tensor | None  # (B, T); None without a critic
    scores: torch.Tensor  # (B,) after the missing-EOS penalty
    raw_scores: torch.Tensor  # (B,) as the reward model / function gave them
    finished: torch.Tensor  # (B,) bool, the response ended with EOS
    entropy: torch.Tensor | None  # (B, T) of the sampling distribution; None like old_logprobs
    # (B, T) log-probs the sampled tokens had in the engine that sampled them, when that
    # is not the trainer (generation.backend=vllm); None with the hf backend.
    sampler_logprobs: torch.Tensor | None = None
    # (B, T) log-probs of the sampled tokens under model.teacher at the sampling temperature
    # (on-policy distillation, docs/distill.md), 0 outside response_mask; None without one
    teacher_logprobs: torch.Tensor | None = None
    # Multi-turn rollouts (rlhf_dist/rollout/agent.py); None for single-turn ones. (B, T) long, 1
    # on every token of the episode: sampled turns AND tool/environment messages, which
    # are attended to but are not in response_mask (never trained on, no KL, no entropy).
    response_attention: torch.Tensor | None = None
    turns: torch.Tensor | None = None  # (B,) long, assistant turns per episode
    tool_calls: torch.Tensor | None = None  # (B,) long, tool messages per episode
    tool_errors: torch.Tensor | None = None  # (B,) long, tool calls that failed
    # (B,) bool, episodes skipped (an observation's image unreadable, rollout/agent.py):
    # out of the loss as an unscored row is (NaN raw score)
    skipped_episodes: torch.Tensor | None = None
    # Routing replay of a mixture-of-experts actor (ppo.routing_replay, docs/moe.md): the
    # expert indices (B, P, L, k) and (B, T, L, k) int64 the update's forwards replay for
    # the prompt and response tokens (L routed layers, top-k), -1 where a token keeps its
    # router's own choice; None with routing_replay none.
    prompt_routing: torch.Tensor | None = None
    response_routing: torch.Tensor | None = None
    # Router metrics of the scoring forward under routing replay (observed, never trained
    # on): each response token's router entropy per layer (B, T, L) float32; r3: whether
    # the trainer's own top-k differs from the sampler's (B, T, L) bool, and with a
    # sampler's log-probs the actor's log-probs without the replay (B, T) float32.
    router_entropy: torch.Tensor | None = None
    router_flips: torch.Tensor | None = None
    unreplayed_logprobs: torch.Tensor | None = None

    @property
    def routing(self) -> torch.Tensor | None:
        """(B, P + T, L, k) the routing the actor's forwards over input_ids replay, or None."""
        if self.prompt_routing is None or self.response_routing is None:
            return None
        return torch.cat([self.prompt_routing, self.response_routing], dim=1)

    # A vision run's pixel inputs of each row's prompt images (data/vision.py); every
    # forward over these rows takes them (`pixel_inputs`). None for text.
    media: RowMedia | None = None

    def pixel_inputs(self) -> Media | None:
        """The model inputs of the rows' images, joined in row order; None without any."""
        return None if self.media is None else self.media.joined()

    @property
    def input_ids(self) -> torch.Tensor:
        """(B, P + T) prompt and response ids."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """(B, P + T) the positions attended to: real prompt tokens and the response's."""
        return torch.cat([self.prompt_mask, self.response_attention_mask], dim=1)

    @property
    def response_attention_mask(self) -> torch.Tensor:
        """(B, T) long: the response positions attended to (response_mask single-turn)."""
        if self.response_attention is not None:
            return self.response_attention
        return self.response_mask.long()

    def select(self, index: Rows) -> RolloutBatch:
        """The rows `index` of every tensor field (B -> the rows selected)."""
        return RolloutBatch(**{f.name: _index(getattr(self, f.name), index) for f in fields(self)})

    def trimmed(self) -> tuple[RolloutBatch, int]:
        """This batch without the columns that are padding in every row, and the number T'
        of response columns kept (a prefix: cut per-token tensors to [:, :T'] alike).

        Dropped: leading prompt columns (left padding of the longest prompt in a larger
        batch) and response columns after every row's last real token. Outputs at the kept
        positions do not change (positions come from the attention mask and causal
        attention never looks right), so losses and gradients are the same while the
        padding costs nothing: a micro-batch drawn from a rollout of ragged lengths is
        often much narrower than the rollout.
        """
        P, T = self.prompt_ids.shape[1], self.response_ids.shape[1]
        cols = torch.arange(max(P, T), device=self.prompt_ids.device)
        first = torch.where(self.prompt_mask.bool().any(0), cols[:P], P).min()
        end = torch.where(self.response_attention_mask.bool().any(0), cols[:T] + 1, 1).max()
        start, keep = torch.stack([first, end]).tolist()  # one host sync for both
        if start == 0 and keep == T:
            return self, T
        cut = {}
        for f in fields(self):
            x = getattr(self, f.name)
            if x is None or isinstance(x, RowMedia):
                pass
            elif f.name.startswith("prompt_"):
                x = x[:, start:]
            elif x.dim() >= 2:  # (B, T, ...) response-aligned
                x = x[:, :keep]
            cut[f.name] = x
        return RolloutBatch(**cut), keep


def _index(x: torch.Tensor | None, index: Rows) -> torch.Tensor | None:
    return None if x is None else x[index]


def scores_with_eos_penalty(
    raw_scores: torch.Tensor, finished: torch.Tensor, penalty: float | None
) -> torch.Tensor:
    """raw_scores (B,) with the score of each response that never emitted EOS (finished
    (B,) False) replaced by `penalty`: a response cut at max_new_tokens is not rewarded
    for text it never finished."""
    if penalty is None:
        return raw_scores
    return torch.where(finished, raw_scores, torch.full_like(raw_scores, penalty))


def sequence_last_index(prompt_width: int, response_mask: torch.Tensor) -> torch.Tensor:
    """Position in the full (P+T) sequence of each response's last real token; (B,)."""
    return prompt_width + last_token_index(response_mask)


def describe_batch(
    tokenizer: PreTrainedTokenizerBase, batch: RolloutBatch, texts: list[str], rows: int = 2
) -> str:
    """The first rows of a rollout, token by token with masks (debug.print_first_batch):
    what the model saw (prompt, attention) and what the losses use (response_mask)."""
    lines = [
        "== first rollout batch (token | prompt attention or response_mask | old logp | ref logp)"
    ]
    for b in range(min(rows, batch.response_ids.shape[0])):
        lines.append(
            f"-- row {b}: score {float(batch.scores[b]):.4g}, finished {bool(batch.finished[b])}: {texts[b]!r}"
        )
        for t, m in zip(batch.prompt_ids[b].tolist(), batch.prompt_mask[b].tolist()):
            lines.append(f"   P {tokenizer.convert_ids_to_tokens(t)!s:>14} | {m}")
        for t in range(batch.response_ids.shape[1]):
            token = tokenizer.convert_ids_to_tokens(int(batch.response_ids[b, t]))
            m = int(batch.response_mask[b, t])
            # old log-probs are not known yet when the update's forward gives them
            old = float("nan") if batch.old_logprobs is None else float(batch.old_logprobs[b, t])
            ref = float("nan") if batch.ref_logprobs is None else float(batch.ref_logprobs[b, t])
            lines.append(f"   R {token!s:>14} | {m} | {old:8.4f} | {ref:8.4f}")
    return "\n".join(lines)
