"""A remote-code-style mixture-of-experts causal LM for the MoE tests (on the tests'
path): its experts are an `nn.ModuleList`, each called only for the tokens routed to it,
as in modeling files shipped with hub models that transformers has not fused. Under
ZeRO-3 with per-module fetching, ranks whose tokens choose different experts then fetch
different parameters: the case `models/moe.py` makes the sparse block a leaf for.
"""

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class ListMoEConfig(PretrainedConfig):
    model_type = "list_moe"

    def __init__(
        self,
        vocab_size=32,
        hidden_size=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        router_aux_loss_coef=0.02,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_local_experts = num_local_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.router_aux_loss_coef = router_aux_loss_coef
        super().__init__(**kwargs)


class ListExpert(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class ListMoEBlock(nn.Module):
    """Top-k router over module-list experts; expert e runs only on its tokens."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = nn.ModuleList(
            ListExpert(config.hidden_size) for _ in range(config.num_local_experts)
        )

    def forward(self, hidden):
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = self.gate(flat)  # (N, E)
        weights, chosen = torch.topk(torch.softmax(logits, -1), self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():  # only the experts some token chose
            rows, slot = torch.where(chosen == e)
            out = out.index_add(0, rows, weights[rows, slot, None] * self.experts[e](flat[rows]))
        return out.reshape(hidden.shape)


class ListMoEForCausalLM(PreTrainedModel):
    config_class = ListMoEConfig
    base_model_prefix = "backbone"

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.moe = ListMoEBlock(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, **_):
        x = self.embed(input_ids)
        return self.lm_head(x + self.moe(x))


def routed_model(seed: int = 0) -> ListMoEForCausalLM:
    """The tiny model with token t routed to expert t % 4 by a wide margin: embedding
    dimension t % 4 is 4, the router reads those four dimensions (weights stay near)."""
    torch.manual_seed(seed)
    model = ListMoEForCausalLM(ListMoEConfig())
    with torch.no_grad():
        model.embed.weight.mul_(0.1)
        ids = torch.arange(model.config.vocab_size)
        model.embed.weight[ids, ids % 4] = 4.0
        model.moe.gate.weight.zero_()
        model.moe.gate.weight[:, :4] = torch.eye(4)
    return model


# Tiny configs of the fused-expert families of transformers 5 (experts as 3-D parameters):
# 2 layers of 4 experts, top-2, each family's own router and block classes.
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "moe_intermediate_size": 32,
                                     "decoder_sparse_step": 1, "head_dim": 16,
                                     "router_aux_loss_coef": 0.01}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "router_aux_loss_coef": 0.02}),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "router_aux_loss_coef": 0.01}),
}  # fmt: skip


def tiny_moe(family: str, tokenizer, out_dir, seed: int = 0):
    """Save a random-init tiny causal LM of `family` (FAMILIES) with `tokenizer` under
    out_dir; returns the path."""
    import transformers
    from transformers import AutoModelForCausalLM

    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    path = f"{out_dir}/{family}"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
