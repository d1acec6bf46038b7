"""Validation: every key's declared choices and range, then the rules between keys
that a stage uses (divisibility by the world size, clip bounds, backends, required
paths); each failure is one ConfigError naming a key, before any model loads."""

from __future__ import annotations

import dataclasses
import os

from rlhf_dist.config import sizes
from rlhf_dist.config.environments import INSTALL as ENV_INSTALL
from rlhf_dist.config.environments import is_environment_spec, parse_environment_spec
from rlhf_dist.config.loading import check_keys
from rlhf_dist.config.rl import PPOConfig, RewardConfig
from rlhf_dist.config.run import RunConfig
from rlhf_dist.config.schema import Config
from rlhf_dist.config.stages import DPOConfig
from rlhf_dist.config.tasks import (
    INSTALL,
    PACKAGES,
    REWARD_MODULE,
    REWARD_PACKAGES,
    held_out_overlap,
    is_task_spec,
    parse_task_spec,
)
from rlhf_dist.errors import ConfigError, RewardFunctionError, UserError  # noqa: F401 (re-exported)
from rlhf_dist.names import (
    ESTIMATORS,
    REFERENCE_FREE_LOSSES,
)


def _divides(small: tuple[str, int], big: tuple[str, int]) -> None:
    if big[1] % small[1]:
        raise ConfigError(f"{small[0]}={small[1]} must divide {big[0]}={big[1]}")


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def validate(cfg: Config, stage: str, world_size: int = 1, *, inputs: bool = True) -> None:
    """Check `cfg` for `stage` ("sft", "rm", "dpo", "kto", "ppo", "eval", "iterate"): every
    key's declared choices and range (`check_keys`), then the rules between keys that
    stage uses; raise ConfigError naming one. `inputs=False` leaves out what only a run
    opens or needs installed: the data (data.train, data.eval, data.ptx and their specs),
    the reward's source, packages (trackio, flash-attn, bitsandbytes, reasoning-gym,
    verifiers) and the hub login: `rlhf-dist plan` reads none of them."""
    check_keys(cfg)
    if inputs:
        _validate_inputs(cfg, stage)
    if stage == "eval" and cfg.generation.environment_endpoint:
        raise ConfigError(
            "generation.environment_endpoint: rlhf-dist eval plays episodes in its own process; "
            "set false (with in-process tools or an environment factory) to evaluate"
        )
    if stage in ("sft", "rm", "dpo", "kto"):
        _validate_stage_section(cfg, stage, world_size, inputs)
    if stage in ("dpo", "kto"):
        _validate_preference(cfg, stage)
    if stage == "ppo":
        _validate_ppo(cfg, world_size, inputs)
    if stage == "iterate":
        _validate_iterate(cfg, world_size)
    if cfg.lora.critic and not cfg.lora.enabled:
        raise ConfigError("lora.critic: needs lora.enabled=true")
    if stage == "rm" and cfg.lora.enabled:  # the adapters would be silently left off
        raise ConfigError(
            "lora.enabled: rlhf-dist rm trains the reward model in full (no adapters); "
            "set lora.enabled=false (PPO's critic takes adapters: lora.critic)"
        )
    if cfg.distributed.sequence_parallel_size > 1:
        _validate_sequence_parallel(cfg, stage, world_size)
    if inputs and cfg.run.push_to_hub:
        _validate_hub(cfg.run)
    if cfg.lora.load_in_4bit:
        _validate_4bit(cfg, inputs)
    if stage in ("ppo", "eval"):
        _validate_generation(cfg)
        if not cfg.model.policy:
            raise ConfigError("model.policy: required (the SFT policy)")
        _validate_reward(cfg, stage, inputs)


def _validate_inputs(cfg: Config, stage: str) -> None:
    """What a run opens or needs installed besides its models, checked before the rules
    between keys (validate's `inputs`): the trackers' and the attention kernel's packages,
    the data and environment specs, held-out data for run.eval_every."""
    if "trackio" in cfg.run.trackers and not _installed("trackio"):
        raise ConfigError(
            "run.trackers: trackio needs the trackio package (pip install 'rlhf_dist[trackio]')"
        )
    _validate_task_data(cfg)
    _validate_environment_specs(cfg)
    training = stage in ("sft", "rm", "dpo", "kto", "ppo")
    if training and cfg.run.eval_every and not cfg.data.eval:
        raise ConfigError(
            f"run.eval_every: {cfg.run.eval_every} needs data.eval (the held-out data to evaluate on)"
        )
    if cfg.model.attn_implementation == "flash_attention_2" and not _installed("flash_attn"):
        raise ConfigError(
            "model.attn_implementation: flash_attention_2 needs the flash-attn package "
            "(pip install flash-attn) and a CUDA GPU; use sdpa or auto otherwise"
        )


def _validate_stage_section(cfg: Config, stage: str, world_size: int, inputs: bool) -> None:
    """sft, rm, dpo, kto: batch sizes that split over the ranks, data and a model."""
    section = getattr(cfg, stage)
    _divides(("world size", world_size), (f"{stage}.batch_size", section.batch_size))
    micro = sizes.micro_batch_size(section.micro_batch_size, section.batch_size, world_size)
    _divides(
        (f"{stage}.micro_batch_size x {world_size} ranks", micro * world_size),
        (f"{stage}.batch_size", section.batch_size),
    )
    if inputs and not cfg.data.train:
        raise ConfigError("data.train: required (a local data file or a hub dataset name)")
    if stage == "sft" and not cfg.model.policy:
        raise ConfigError("model.policy: required (the causal LM to fine-tune)")
    if stage == "rm" and not (cfg.model.reward or cfg.model.policy):
        raise ConfigError("model.reward: required (the model to train as reward model)")


def _validate_reward(cfg: Config, stage: str, inputs: bool) -> None:
    """An RL or eval stage's reward: some source (with `inputs`), well-formed function
    specs, and what the sources need (ppo.estimator=distill and a verifiers environment's
    rubric need none)."""
    distill_alone = stage == "ppo" and cfg.ppo.estimator == "distill"  # no task reward
    # an environment scores its episodes itself (a verifiers environment's rubric always
    # does; an episode of another that returns none stops the run: rollout/collect.py)
    environment = stage == "ppo" and bool(cfg.generation.environment)
    given = cfg.reward.text_rewards() or cfg.model.reward or distill_alone or environment
    if inputs and not given:
        raise ConfigError(
            "model.reward: required unless reward.function, reward.functions, reward.url "
            "or reward.judge is set (or ppo.estimator=distill, or a generation.environment "
            "that returns its episodes' rewards)"
        )
    if cfg.reward.function and ":" not in cfg.reward.function:  # reward.functions: a model
        raise ConfigError(
            f"reward.function: expected 'module:callable', got {cfg.reward.function!r} "
            "(a reward model goes in model.reward or reward.functions)"
        )
    _validate_reward_sources(cfg.reward)
    if inputs:
        _validate_task_rewards(cfg.reward)


def _validate_hub(run: RunConfig) -> None:
    """run.push_to_hub: a valid repository id and a token, checked before training so that
    a long run does not end in a failed upload for want of either."""
    # huggingface_hub is imported here only: runs that do not push never load it.
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not run.hub_model_id:
        raise ConfigError("run.hub_model_id: required with run.push_to_hub=true (user/name)")
    try:
        validate_repo_id(run.hub_model_id)
    except HFValidationError:
        raise ConfigError(
            f"run.hub_model_id: {run.hub_model_id!r} is not a hub repo id (name, user/name or "
            "org/name of letters, digits, '-', '_' and '.', at most 96 characters)"
        ) from None
    if not (os.environ.get(run.hub_token_env) or get_token()):
        raise ConfigError(
            f"run.hub_token_env: run.push_to_hub needs a hub token: none in ${run.hub_token_env} "
            "and no saved login (hf auth login)"
        )


def _validate_4bit(cfg: Config, inputs: bool) -> None:
    """lora.load_in_4bit: LoRA on, and (with `inputs`) a bitsandbytes that loads with a
    usable backend here."""
    if not cfg.lora.enabled:
        raise ConfigError("lora.load_in_4bit: needs lora.enabled=true (QLoRA trains adapters)")
    problem = bitsandbytes_problem() if inputs else ""
    if problem:
        raise ConfigError(f"lora.load_in_4bit: {problem}")


def bitsandbytes_problem() -> str:
    """Why bitsandbytes cannot quantize to NF4 here ("" when it can): checked by
    quantizing one small tensor, which fails where no backend (CUDA or CPU) exists."""
    if not _installed("bitsandbytes"):
        return "needs the bitsandbytes package (pip install bitsandbytes)"
    try:
        import torch
        from bitsandbytes.functional import dequantize_4bit, quantize_4bit

        device = "cuda" if torch.cuda.is_available() else "cpu"
        x = torch.ones(64, 4, device=device)
        packed, state = quantize_4bit(x, quant_type="nf4")
        dequantize_4bit(packed, state)
    except Exception as e:  # no backend for this device, a broken build
        return f"bitsandbytes has no usable NF4 backend here ({type(e).__name__}: {e})"
    return ""


def _validate_reward_sources(r: RewardConfig) -> None:
    """Several rewards, the remote reward model and the judge (docs/rewards.md)."""
    if r.function and r.functions:
        raise ConfigError("reward.function and reward.functions: set one of them, not both")
    if r.weights and len(r.weights) != len(r.functions):
        raise ConfigError(
            f"reward.weights: {len(r.weights)} weights for {len(r.functions)} reward.functions"
        )
    for name in ("url", "judge_url"):
        value = getattr(r, name)
        if value and not value.startswith(("http://", "https://")):
            raise ConfigError(f"reward.{name}: expected an http:// or https:// URL, got {value!r}")
    if r.judge == "model" and not r.judge_model:
        raise ConfigError("reward.judge_model: required with reward.judge=model (a causal LM path)")
    if r.judge == "url" and not (r.judge_url and r.judge_model_name):
        raise ConfigError(
            "reward.judge_url and reward.judge_model_name: required with reward.judge=url"
        )
    if r.judge != "none" and not (
        "{prompt}" in r.judge_template and "{response}" in r.judge_template
    ):
        raise ConfigError("reward.judge_template: must contain {prompt} and {response}")
    if r.api_key_env and not r.api_key_env.replace("_", "").isalnum():
        raise ConfigError(
            f"reward.api_key_env: the NAME of an environment variable, got {r.api_key_env!r}"
        )


def _validate_environment_specs(cfg: Config) -> None:
    """`verifiers:` specs (config/environments.py): well formed, verifiers installed, and
    as generation.environment only through the endpoint (verifiers drives an OpenAI
    client, never our in-process turns)."""
    g, d = cfg.generation, cfg.data
    for key, value in (
        ("data.train", d.train), ("data.eval", d.eval), ("generation.environment", g.environment)
    ):  # fmt: skip
        if is_environment_spec(value):
            parse_environment_spec(value, key)
            if not _installed("verifiers"):
                raise ConfigError(f"{key}: {value!r} needs the verifiers package: {ENV_INSTALL}")
    if is_environment_spec(g.environment) and not g.environment_endpoint:
        raise ConfigError(
            "generation.environment: a verifiers environment plays through the rollout "
            "servers' chat endpoint: set generation.environment_endpoint=true "
            "(with generation.backend=server)"
        )


def _validate_task_data(cfg: Config) -> None:
    """data.train / data.eval naming a reasoning-gym task (config/tasks.py): a well-formed
    spec, reasoning-gym installed, and held-out rows drawn from seeds data.train does not
    use."""
    d = cfg.data
    specs = {}
    for key, value in (("data.train", d.train), ("data.eval", d.eval)):
        if is_task_spec(value):
            specs[key] = parse_task_spec(value, key)
            _require_package(key, "reasoning_gym tasks need", "reasoning_gym")
    if len(specs) == 2:
        overlap = held_out_overlap(specs["data.train"], specs["data.eval"])
        if overlap:
            raise ConfigError(f"data.eval: {d.eval!r}: {overlap}")


def _validate_task_rewards(r: RewardConfig) -> None:
    """The shipped task rewards (rlhf_dist/rewards/tasks.py) need their package installed."""
    for key, spec in [("reward.function", r.function)] + [
        ("reward.functions", s) for s in r.functions
    ]:
        module, _, name = spec.partition(":")
        if module == REWARD_MODULE and name in REWARD_PACKAGES:
            _require_package(key, f"{spec} needs", REWARD_PACKAGES[name])


def _require_package(key: str, what: str, module: str) -> None:
    """A ConfigError naming `key` and the tasks extra unless `module` can be imported;
    `what` begins the message ("reasoning_gym tasks need")."""
    if not _installed(module):
        raise ConfigError(
            f"{key}: {what} the {PACKAGES[module]} package, which is not installed: {INSTALL}"
        )


def _validate_objective(cfg: Config) -> None:
    """The estimator's needs and the policy-loss knobs (clip bounds, dual clip, entropy)."""
    p = cfg.ppo
    estimator = ESTIMATORS[p.estimator]
    if estimator.needs_groups and p.samples_per_prompt < 2:
        raise ConfigError(
            f"ppo.samples_per_prompt: estimator {p.estimator} compares the samples of a prompt; "
            f"needs >= 2, got {p.samples_per_prompt}"
        )
    if not estimator.needs_critic and cfg.lora.critic:
        raise ConfigError(f"lora.critic: estimator {p.estimator} trains no critic; set it false")
    for name in ("clip_eps_low", "clip_eps_high", "dual_clip"):
        if getattr(p, name) is not None and p.clip_eps is None:
            raise ConfigError(f"ppo.{name}: needs ppo.clip_eps set (clipping on)")
    if p.clip_eps_low is not None and p.clip_eps_low >= 1 and p.policy_loss != "cispo":
        raise ConfigError(
            f"ppo.clip_eps_low: must be < 1 (1 = no lower bound: cispo only), got {p.clip_eps_low}"
        )
    if p.policy_loss == "cispo" and p.dual_clip is not None:
        raise ConfigError(
            "ppo.dual_clip: bounds PPO's clipped surrogate (policy_loss=clip); cispo's weight "
            "is already bounded, set dual_clip null"
        )
    _validate_dapo(cfg)
    _validate_entropy_control(p)
    _validate_distill(cfg)
    _validate_rollout_correction(cfg)
    _validate_routing_replay(cfg)


def _validate_routing_replay(cfg: Config) -> None:
    """ppo.routing_replay (docs/moe.md, "Routing replay"): what records a rollout's routing
    and what would replay it wrongly. Whether the actor has routers is checked when it
    loads (models/routing.py `require_routers`)."""
    mode = cfg.ppo.routing_replay
    if mode == "none":
        return
    if mode == "r3" and cfg.generation.backend not in ("hf", "server"):
        raise ConfigError(
            f"ppo.routing_replay: r3 records the sampler's routing in the decode loop "
            f"(generation.backend=hf or server); {cfg.generation.backend} does not expose it"
        )
    if cfg.model.gradient_checkpointing:
        raise ConfigError(
            "ppo.routing_replay: model.gradient_checkpointing recomputes the forward in "
            "backward, outside the replayed routing; set it false"
        )
    if cfg.distributed.sequence_parallel_size > 1:
        raise ConfigError(
            "ppo.routing_replay: distributed.sequence_parallel_size > 1 splits a row's "
            "tokens over ranks; routing replay needs whole rows"
        )
    if cfg.ppo.estimator == "online_dpo":
        raise ConfigError(
            "ppo.routing_replay: ppo.estimator=online_dpo trains pairs by its own forwards, "
            "which do not replay a rollout's routing; set routing_replay none"
        )
    if mode == "r3" and cfg.ppo.max_staleness:
        raise ConfigError(
            "ppo.routing_replay: r3 with ppo.max_staleness > 0 is not supported (the rollout "
            "requested ahead does not carry the routing yet); set max_staleness 0"
        )
    if cfg.ppo.dynamic_sampling:
        raise ConfigError(
            "ppo.routing_replay: ppo.dynamic_sampling joins rollouts of other widths; the "
            "recorded routing is not joined yet, set one of them off"
        )
    if cfg.generation.tools or cfg.generation.environment:
        raise ConfigError(
            "ppo.routing_replay: multi-turn rollouts (generation.tools / environment) are not "
            "recorded yet; single-turn rollouts only"
        )


def _validate_rollout_correction(cfg: Config) -> None:
    """ppo.rollout_correction and ppo.max_staleness (docs/algorithms.md, "Rollout
    correction"; docs/serving.md, "Asynchronous rollouts")."""
    p, backend = cfg.ppo, cfg.generation.backend
    if p.rollout_correction != "none" and backend not in ("vllm", "server"):
        raise ConfigError(
            "ppo.rollout_correction: needs generation.backend=vllm or server (the hf sampler is "
            "the trainer)"
        )
    if p.decoupled and backend not in ("vllm", "server"):
        raise ConfigError(
            "ppo.decoupled: needs generation.backend=vllm or server (the behaviour policy's "
            "log-probs come from the sampler; with hf the sampler is the trainer)"
        )
    if p.rollout_correction == "icepop" and p.rollout_correction_level != "token":
        raise ConfigError("ppo.rollout_correction_level: icepop masks tokens; set token")
    if p.rollout_correction_low >= p.rollout_correction_high:
        raise ConfigError(
            f"ppo.rollout_correction_low: must be below ppo.rollout_correction_high "
            f"({p.rollout_correction_high:g}), got {p.rollout_correction_low:g}"
        )
    if p.rollout_correction_low != PPOConfig().rollout_correction_low and (
        p.rollout_correction != "icepop"
    ):
        raise ConfigError("ppo.rollout_correction_low: only icepop reads it")
    _validate_staleness(cfg)


def _validate_staleness(cfg: Config) -> None:
    """ppo.max_staleness: rollout servers only, with the loop's plain rollout or
    multi-turn episodes (played here or through the endpoint; generation/prefetch.py)."""
    p, g = cfg.ppo, cfg.generation
    if p.partial_rollouts and not (p.max_staleness >= 1 and g.backend == "server"):
        raise ConfigError(
            "ppo.partial_rollouts: needs generation.backend=server and ppo.max_staleness >= 1 "
            "(updates land on servers that generate beside the update)"
        )
    if p.partial_rollouts and (g.environment_endpoint or g.tools or g.environment):
        raise ConfigError(
            "ppo.partial_rollouts: not with multi-turn episodes (generation.tools / "
            "environment: an episode's turns are checked to share one version); set false"
        )
    if not p.max_staleness:
        return
    if g.backend != "server":
        raise ConfigError(
            f"ppo.max_staleness: needs generation.backend=server (with {g.backend} the trainer's "
            "own ranks generate: nothing runs beside the update); set 0"
        )
    refused = (
        ("ppo.estimator", p.estimator == "online_dpo", "online_dpo"),
        ("ppo.dynamic_sampling", p.dynamic_sampling, "true"),
    )
    for name, on, value in refused:
        if on:
            raise ConfigError(f"{name}: {value} needs ppo.max_staleness=0 (on-policy rollouts)")


def _validate_entropy_control(p: PPOConfig) -> None:
    """The adaptive entropy coefficient and Clip-Cov's bounds (docs/algorithms.md)."""
    if p.entropy_target is not None and p.entropy_coef > p.entropy_coef_max:
        raise ConfigError(
            f"ppo.entropy_coef: the adaptive coefficient starts here and stays within [0, "
            f"ppo.entropy_coef_max={p.entropy_coef_max}], got {p.entropy_coef}"
        )
    sequences = p.rollout_batch_size * p.samples_per_prompt
    minibatch = sizes.ppo_minibatch_size(
        p.minibatch_size, p.rollout_batch_size, p.samples_per_prompt
    )
    steps = sizes.ppo_epochs(p.ppo_epochs, p.estimator) * (sequences // minibatch)
    if p.cov_control == "kl_cov" and steps == 1:
        raise ConfigError(
            "ppo.cov_control: kl_cov penalises |log pi - log pi_old|, which is 0 with no "
            "gradient at a rollout's only optimizer step; needs ppo.ppo_epochs > 1 or "
            "ppo.minibatch_size below the rollout's sequences (or use clip_cov)"
        )
    if p.cov_control == "clip_cov" and not p.cov_clip_low < p.cov_clip_high:
        raise ConfigError(
            f"ppo.cov_clip_high: must be above ppo.cov_clip_low={p.cov_clip_low} (Clip-Cov's "
            f"candidates lie between them), got {p.cov_clip_high}"
        )


def _validate_dapo(cfg: Config) -> None:
    """Dynamic sampling and overlong handling (DAPO, Yu et al. 2025)."""
    p = cfg.ppo
    if p.dynamic_sampling:
        if not ESTIMATORS[p.estimator].needs_groups:
            raise ConfigError(
                f"ppo.dynamic_sampling: drops groups of tied scores, so it needs a group "
                f"estimator (grpo, rloo, reinforce_pp_baseline), got ppo.estimator={p.estimator}"
            )
        if cfg.debug.overfit_one_batch:
            raise ConfigError(
                "ppo.dynamic_sampling: extra rounds draw other prompts; it cannot be combined "
                "with debug.overfit_one_batch"
            )
    if p.overlong == "soft" and not 0 < p.overlong_buffer <= cfg.generation.max_new_tokens:
        raise ConfigError(
            f"ppo.overlong_buffer: must be in [1, generation.max_new_tokens="
            f"{cfg.generation.max_new_tokens}] with ppo.overlong=soft, got {p.overlong_buffer}"
        )


def _validate_distill(cfg: Config) -> None:
    """On-policy distillation (docs/distill.md): a teacher where the estimator needs one,
    and a weight for the teacher that is set."""
    p, teacher = cfg.ppo, cfg.model.teacher
    if p.estimator == "distill" and not teacher:
        raise ConfigError(
            "model.teacher: required with ppo.estimator=distill (the model to distill from)"
        )
    if teacher and not p.distill_coef > 0:
        raise ConfigError(
            "ppo.distill_coef: 0 turns off distillation from model.teacher; set it > 0 or "
            "leave model.teacher empty"
        )


SP_KEY = "distributed.sequence_parallel_size"


def _validate_sequence_parallel(cfg: Config, stage: str, world_size: int) -> None:
    """Sequence parallelism (docs/distributed.md): the world splits into groups, and only
    the steps that pool their micro-batches over a group (SFT, DPO, KTO, the critic-free
    PPO update) can run split."""
    n = cfg.distributed.sequence_parallel_size
    _divides((SP_KEY, n), ("world size", world_size))
    if stage == "rm":
        raise ConfigError(f"{SP_KEY}={n}: rm does not split sequences; set it to 1")
    if stage != "ppo":
        return
    p = cfg.ppo
    unsupported = {
        "ppo.estimator": p.estimator == "online_dpo" or ESTIMATORS[p.estimator].needs_critic,
        "ppo.ptx_coef": p.ptx_coef > 0,
        "ppo.distill_loss": bool(cfg.model.teacher) and p.distill_loss == "gjsd",
    }
    for name, refused in unsupported.items():
        if refused:
            value = getattr(p, name.split(".")[1])
            raise ConfigError(
                f"{SP_KEY}={n}: not supported with {name}={value} (critic-free estimators, "
                "no PPO-ptx, no gjsd distillation); set it to 1"
            )


def _validate_preference(cfg: Config, stage: str) -> None:
    """dpo / kto: the policy to train and the loss's constants."""
    section = getattr(cfg, stage)
    if not cfg.model.policy:
        raise ConfigError(f"model.policy: required (the SFT policy {stage} trains)")
    if stage == "dpo":
        _validate_dpo_loss(section)


def _validate_dpo_loss(d: DPOConfig) -> None:
    """A key that only one dpo.loss_type reads, set away from its default under another."""
    kind = d.loss_type
    if d.label_smoothing and kind not in ("sigmoid", "simpo"):
        raise ConfigError(
            f"dpo.label_smoothing: smooths the sigmoid and simpo losses only; "
            f"dpo.loss_type={kind} takes label_smoothing=0"
        )
    default = DPOConfig()
    if kind != "simpo" and d.simpo_gamma != default.simpo_gamma:
        raise ConfigError(f"dpo.simpo_gamma: read by dpo.loss_type=simpo only, not {kind}")
    if kind != "orpo" and d.orpo_prompt_nll != default.orpo_prompt_nll:
        raise ConfigError(f"dpo.orpo_prompt_nll: read by dpo.loss_type=orpo only, not {kind}")
    if kind in REFERENCE_FREE_LOSSES and d.reference_logprobs != default.reference_logprobs:
        raise ConfigError(
            f"dpo.reference_logprobs: dpo.loss_type={kind} uses no reference model; "
            "leave the key unset"
        )


def _validate_generation(cfg: Config) -> None:
    g = cfg.generation
    if g.min_new_tokens > g.max_new_tokens:
        raise ConfigError(
            f"generation.min_new_tokens: must be in [0, max_new_tokens], got {g.min_new_tokens}"
        )
    if g.tools or g.environment:
        _validate_multi_turn(cfg)
    if g.environment_endpoint:
        _validate_endpoint_environment(cfg)
    if g.backend == "vllm" and not cfg.perf.gather_for_generation:
        raise ConfigError(
            "generation.backend=vllm: needs perf.gather_for_generation=true (the engine "
            "loads whole weights, gathered once per rollout)"
        )
    _validate_server(cfg)


def _validate_server(cfg: Config) -> None:
    """generation.backend=server and its keys (docs/serving.md)."""
    g = cfg.generation
    if g.backend != "server":
        if g.server_urls:
            raise ConfigError("generation.server_urls: read by generation.backend=server only")
        return
    if not g.server_urls:
        raise ConfigError("generation.server_urls: generation.backend=server needs at least one")
    for url in g.server_urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"generation.server_urls: expected http(s)://host:port, got {url!r}")
    if cfg.lora.load_in_4bit:
        raise ConfigError(
            "generation.backend=server: not with lora.load_in_4bit (the servers fold the "
            "adapters into their own unquantized copy of model.policy, not the NF4 base "
            "the trainer trains against)"
        )


def _validate_endpoint_environment(cfg: Config) -> None:
    """generation.environment_endpoint: an environment that calls the servers' endpoint."""
    g = cfg.generation
    if not g.environment:
        raise ConfigError("generation.environment_endpoint: needs generation.environment")
    if g.backend != "server":
        raise ConfigError(
            "generation.environment_endpoint: needs generation.backend=server (the environment "
            "calls the rollout servers' chat endpoint)"
        )
    if cfg.run.eval_every:
        raise ConfigError(
            "run.eval_every: not with generation.environment_endpoint (held-out evaluation "
            "plays episodes in this process); evaluate the exported policy with its own run"
        )


def _validate_multi_turn(cfg: Config) -> None:
    """generation.tools / environment: what multi-turn rollouts support (docs/agents.md)."""
    g = cfg.generation
    if g.tools and g.environment:
        raise ConfigError("generation.tools: not together with generation.environment")
    for spec in (*g.tools, g.environment):
        if spec and ":" not in spec:
            raise ConfigError(
                f"generation.tools/environment: expected 'module:callable', got {spec!r}"
            )
    if g.max_turns < 1 or g.max_episode_tokens < 0 or not g.tool_timeout_s > 0:
        raise ConfigError(
            "generation.max_turns must be >= 1, max_episode_tokens >= 0 and tool_timeout_s > 0"
        )


def _validate_ppo(cfg: Config, world_size: int, inputs: bool) -> None:
    p = cfg.ppo
    _divides(("world size", world_size), ("ppo.rollout_batch_size", p.rollout_batch_size))
    sequences = p.rollout_batch_size * p.samples_per_prompt
    minibatch = sizes.ppo_minibatch_size(
        p.minibatch_size, p.rollout_batch_size, p.samples_per_prompt
    )
    _divides(
        ("ppo.minibatch_size", minibatch),
        ("ppo.rollout_batch_size x ppo.samples_per_prompt", sequences),
    )
    _divides(("world size", world_size), ("ppo.minibatch_size", minibatch))
    micro = sizes.micro_batch_size(p.micro_batch_size, minibatch, world_size)
    _divides(
        (f"ppo.micro_batch_size x {world_size} ranks", micro * world_size),
        ("ppo.minibatch_size", minibatch),
    )
    _validate_objective(cfg)
    _validate_online_dpo(cfg, minibatch // world_size)
    if inputs and not cfg.data.train:
        raise ConfigError("data.train: required (a prompt file or a hub dataset name)")
    if inputs and p.ptx_coef > 0 and not cfg.data.ptx:
        raise ConfigError(
            f"ppo.ptx_coef: {p.ptx_coef} needs data.ptx (the SFT-format rows of the ptx term)"
        )
    if cfg.data.ptx and not p.ptx_coef > 0:
        raise ConfigError(
            "data.ptx: set, but ppo.ptx_coef is 0 (ptx off): set ppo.ptx_coef > 0 or leave "
            "data.ptx empty"
        )


# What ppo.estimator=online_dpo does not read: the policy-gradient loss's knobs, and the
# KL penalty's placement and controller (beta = ppo.kl_coef is in the DPO loss itself).
# Set away from their defaults they would be silently ignored, so they are refused.
NOT_ONLINE_DPO = (
    "clip_eps_low", "clip_eps_high", "dual_clip", "policy_loss", "ratio_level",
    "loss_aggregation", "entropy_coef", "entropy_target", "cov_control", "ptx_coef",
    "rollout_correction", "whiten_advantages", "kl_placement", "kl_controller", "micro_batch_tokens",
)  # fmt: skip


def _validate_online_dpo(cfg: Config, rank_minibatch: int) -> None:
    """ppo.estimator=online_dpo (docs/online_dpo.md): beta > 0, the keys it does not read
    left unset, and a rank's share of a minibatch made of whole groups (a group is one
    pair); rank_minibatch: sequences per rank per optimizer step."""
    p, default = cfg.ppo, PPOConfig()
    if p.estimator != "online_dpo":
        if p.dpo_loss != default.dpo_loss:
            raise ConfigError(
                f"ppo.dpo_loss: read by ppo.estimator=online_dpo only, not {p.estimator}"
            )
        return
    if not p.kl_coef > 0:
        raise ConfigError("ppo.kl_coef: DPO's beta with ppo.estimator=online_dpo; must be > 0")
    for name in NOT_ONLINE_DPO:
        if getattr(p, name) != getattr(default, name):
            raise ConfigError(
                f"ppo.{name}: not read by ppo.estimator=online_dpo (the DPO loss on pairs "
                "replaces the policy-gradient loss); leave it unset"
            )
    if p.overlong == "mask" or cfg.model.teacher:
        key = "ppo.overlong" if p.overlong == "mask" else "model.teacher"
        raise ConfigError(f"{key}: not supported with ppo.estimator=online_dpo")
    if rank_minibatch % p.samples_per_prompt:
        raise ConfigError(
            f"ppo.minibatch_size: with ppo.estimator=online_dpo each rank's share of a "
            f"minibatch ({rank_minibatch} sequences) must be whole groups of "
            f"ppo.samples_per_prompt={p.samples_per_prompt} (one pair each)"
        )


def _validate_iterate(cfg: Config, world_size: int) -> None:
    """rlhf-dist iterate: its own keys, then the RM, PPO and eval stages it derives (with
    the reward model each round trains standing in for model.reward)."""
    it = cfg.iterate
    if it.labeller == "gold" and not cfg.eval.gold_function:
        raise ConfigError(
            "iterate.labeller: gold labels with eval.gold_function, which is not set "
            "(set it, or name a module:function(prompt, a, b) labeller)"
        )
    if it.labeller != "gold" and ":" not in it.labeller:
        raise ConfigError(
            f"iterate.labeller: expected gold or 'module:function', got {it.labeller!r}"
        )
    if not cfg.data.eval:
        raise ConfigError(
            "data.eval: required by iterate (the held-out prompts of each round's pairs and gold)"
        )
    if cfg.reward.function:
        raise ConfigError("reward.function: iterate scores PPO with the reward model it trains")
    stand_in = dataclasses.replace(cfg.model, reward=cfg.model.reward or cfg.model.policy)
    derived = dataclasses.replace(cfg, model=stand_in)
    for stage in ("rm", "ppo", "eval"):
        validate(derived, stage, world_size)
