"""Reading scores and values off models.

- reward model: `AutoModelForSequenceClassification` (num_labels=1); the score of a
  sequence is the head applied to the hidden state of its LAST real token.
- critic: a backbone plus a scalar head, applied at every position (`ValueModel`),
  initialised from the reward model (the "N+" study: Huang et al. 2024, "The N+
  Implementation Details of RLHF with PPO") or from the policy with a zero head.
- `ActorCritic` holds actor and critic in one module so one engine/optimizer serves both.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from rlhf_dist.algo.packing import unpack_tokens
from rlhf_dist.config import Config, PerfConfig
from rlhf_dist.data.vision import Media
from rlhf_dist.engine import packing
from rlhf_dist.engine.forward import DEFAULT_PERF, Divergence, causal_lm, token_forward
from rlhf_dist.errors import ConfigError
from rlhf_dist.models.loading import HEAD_NAMES, load_sequence_classifier
from rlhf_dist.models.routing import RoutingSpan, plain_path


def split_classifier(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(backbone, head) of a sequence classifier: backbone gives hidden states (B, L, H)."""
    if hasattr(model, "get_base_model"):  # peft: the transformers model with adapters injected
        model = model.get_base_model()
    backbone = getattr(model, model.base_model_prefix)
    for name in HEAD_NAMES:
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return backbone, head
    raise ConfigError(f"model: cannot find the classification head of {type(model).__name__}")


class ValueModel(nn.Module):
    """Backbone + scalar head applied at every position: per-token values or scores.
    perf: the speed paths of its forward (perf.packed_sequences), given when built."""

    def __init__(self, classifier: nn.Module, perf: PerfConfig = DEFAULT_PERF):
        super().__init__()
        split_classifier(classifier)  # fail early if it has no recognisable head
        # Kept whole (not as backbone + head) so that save_pretrained writes the
        # AutoModelForSequenceClassification checkpoint users load back.
        self.classifier = classifier
        self.perf = perf

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, attention_mask: (B, L). Returns (B, L) float32 head outputs.

        With perf.packed_sequences the backbone and head run on the packed rows
        (`packing_layout`; position_ids must be None: positions restart per sequence)
        and the outputs come back in the padded layout, 0 at padding."""
        backbone, head = split_classifier(self.classifier)
        lm, packed = causal_lm(self.classifier), self.perf.packed_sequences
        layout = packing.packing_layout(lm, attention_mask, packed)
        inputs = packing.backbone_inputs(input_ids, attention_mask, layout)
        if position_ids is not None:
            if layout is not None:
                raise ValueError("ValueModel: packed sequences take their own position ids")
            inputs["position_ids"] = position_ids
        hidden = backbone(**inputs, use_cache=False).last_hidden_state  # see final_hidden_states
        values = head(hidden).squeeze(-1).float()
        return values if layout is None else unpack_tokens(values, layout[1])


def sequence_scores(
    value_model: ValueModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    last_index: torch.Tensor,
) -> torch.Tensor:
    """Score of each sequence read at `last_index` (B,), its last real token. Returns (B,)."""
    per_token = value_model(input_ids, attention_mask)
    return per_token.gather(1, last_index.long().unsqueeze(1)).squeeze(1)


class ActorCritic(nn.Module):
    """Actor and critic in one module: one `prepare`, one optimizer, one engine (TRL layout).
    perf: the speed paths of the actor's forward (token_logprobs), given when built."""

    def __init__(
        self, actor: nn.Module, critic: ValueModel | None, perf: PerfConfig = DEFAULT_PERF
    ):
        super().__init__()
        self.actor = actor
        self.critic = critic  # None: a critic-free estimator (grpo, rloo, reinforce_pp*)
        self.perf = perf

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_mask: torch.Tensor,
        temperature: float = 1.0,
        with_entropy: bool = False,
        with_actor: bool = True,
        with_critic: bool = True,
        share_prompts: bool = True,
        divergence: Divergence | None = None,
        routing: RoutingSpan | None = None,
        media: Media | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """Log-probs, entropies and values at the positions that predict the last
        T = response_mask.shape[1] tokens.

        input_ids, attention_mask: (B, P+T) with left-padded prompt then response;
        response_mask: (B, T) bool. Returns logprobs (B, T) of the response tokens at the
        sampling `temperature` (0 outside response_mask; `token_logprobs`), entropies
        (B, T) or None (`with_entropy`), and values (B, T): position P-1+t predicts token
        P+t, and its value is V(prompt + response[:t]); values is None without a critic,
        logprobs and entropies None with with_actor=False (a critic-only pass), values None
        with with_critic=False (an actor-only pass: PPO-ptx's SFT rows, trainers/ppo/ptx.py).
        share_prompts: the first P columns are a prompt that rows may share
        (perf.shared_prompt_forward); False for rows that are not prompt + response
        (PPO-ptx's SFT rows, where every column but the first is scored).
        divergence: a function of the actor's final hidden states at the response tokens
        (engine.forward.token_forward; on-policy distillation's GJSD to a teacher): then a
        fourth output, its per-token values (B, T), 0 outside response_mask.
        routing: a mixture-of-experts actor's forward runs inside this span over the
        actor's routers (models/routing.py: recording, or replaying a (B, P+T, L, k)
        routing), on the plain path that keeps the P + T layout of a recording.
        media: a vision-language actor's pixel inputs of the batch's images
        (data/vision.py), for the actor's forward; the critic reads text only.
        """
        logprobs: torch.Tensor | None = None
        entropy: torch.Tensor | None = None
        values: torch.Tensor | None = None
        div: torch.Tensor | None = None
        if with_actor:
            P = input_ids.shape[1] - response_mask.shape[1]
            perf = self.perf if routing is None else plain_path(self.perf)
            with contextlib.nullcontext() if routing is None else routing.on(self.actor):
                logprobs, entropy, div = token_forward(
                    self.actor,
                    input_ids,
                    attention_mask,
                    response_mask,
                    temperature,
                    with_entropy,
                    P if share_prompts else None,
                    perf,
                    divergence,
                    media,
                )
        if self.critic is not None and with_critic:
            T = response_mask.shape[1]
            values = self.critic(input_ids, attention_mask)[:, -T - 1 : -1]
        if divergence is not None:
            return logprobs, entropy, values, div
        return logprobs, entropy, values


def sub_state_dict(state: dict, prefix: str) -> dict:
    """The entries of a module's state dict under `prefix` (e.g. "actor.", "critic.classifier."),
    keyed as the submodule itself names them (the prefix removed)."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def build_critic(cfg: Config, dtype: str = "float32") -> ValueModel:
    """Critic from the reward model (value head = RM head) or from the policy (zero head)."""
    m = cfg.model
    if cfg.ppo.critic_init == "reward":
        if not m.reward:
            raise ConfigError("ppo.critic_init: 'reward' needs model.reward (or use 'policy')")
        classifier = load_sequence_classifier(m.reward, "model.reward", dtype, m)
    else:
        classifier = load_sequence_classifier(m.policy, "model.policy", dtype, m, new_head=True)
        _, head = split_classifier(classifier)
        # A zero head starts every value at 0: no random value noise in the first advantages.
        nn.init.zeros_(head.weight)
        if getattr(head, "bias", None) is not None:
            nn.init.zeros_(head.bias)
    return ValueModel(classifier, cfg.perf)
