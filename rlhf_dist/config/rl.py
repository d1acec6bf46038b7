"""Sections of on-policy training: sampling (`generation`), where scores come from
(`reward`), the PPO loop and its objectives (`ppo`), held-out evaluation (`eval`) and
iterative RLHF (`iterate`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_dist.config.keys import key
from rlhf_dist.config.stages import OptimConfig
from rlhf_dist.errors import ConfigError, RewardFunctionError, UserError  # noqa: F401 (re-exported)
from rlhf_dist.names import (
    COV_CONTROLS,
    DISTILL_LOSSES,
    ESTIMATORS,
    KL_KINDS,
    LOSS_AGGREGATIONS,
    ONLINE_DPO_LOSSES,
    OVERLONG,
    POLICY_LOSSES,
    RATIO_LEVELS,
    ROLLOUT_CORRECTIONS,
)


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = key(512, "response tokens at most (TRL's max_completion_length)", gt=0)
    min_new_tokens: int = key(
        0, "EOS is suppressed until this many tokens were generated (0: no minimum)", min=0
    )
    temperature: float = key(0.7, "sampling temperature (PPO's log-probabilities use it too)", gt=0)
    top_k: int = key(0, "sample among the k most likely tokens; 0 = all", min=0)
    top_p: float = key(
        1.0, "nucleus sampling: the smallest set of tokens with this mass; 1 = all", gt=0, max=1
    )
    stop_token_ids: tuple[int, ...] = key(
        (),
        "token ids that end a response besides the tokenizer's EOS, the policy's "
        "generation_config.eos_token_id and the chat template's end-of-turn token (docs/data.md)",
        min=0,
    )
    backend: str = key(
        "hf",
        "what samples PPO rollouts: hf (our decode loop over the actor, the reference), vllm "
        "(one in-process vLLM engine per rank, weights synced before every rollout; needs the "
        "vllm extra, docs/distributed.md) or server (rlhf-dist serve processes at "
        "generation.server_urls, weights broadcast to them before every rollout; docs/serving.md)",
        choices=("hf", "vllm", "server"),
    )
    server_urls: tuple[str, ...] = key(
        (),
        "generation.backend=server: base URLs of rlhf-dist serve processes (http://host:port); "
        "with several, each rank's prompts are cut into one shard per server (data-parallel)",
    )
    server_token_env: str = key(
        "RLHF_DIST_SERVER_TOKEN",
        "generation.backend=server: the environment variable holding the servers' shared token "
        "(sent as 'Authorization: Bearer ...'; the token itself is never logged or written)",
    )
    server_sync_address: str = key(
        "127.0.0.1",
        "generation.backend=server: the address of trainer rank 0 the servers connect to for "
        "the weight broadcast (a torch.distributed group of rank 0 and the servers)",
    )
    server_sync_bucket_mb: float = key(
        64.0,
        "generation.backend=server: MiB of weights announced and broadcast at a time",
        gt=0,
    )
    server_sync_tolerance: float = key(
        0.01,
        "generation.backend=server: after each weight sync the servers score fixed sequences; a "
        "mean absolute per-token log-prob gap to the trainer's above this stops the run",
        gt=0,
    )
    vllm_gpu_memory_utilization: float = key(
        0.3,
        "vllm on GPU: share of the GPU's memory the engine takes (weights + KV cache)",
        gt=0,
        max=1,
    )
    vllm_kv_cache_gib: float = key(
        0.0,
        "vllm: KV cache per rank in GiB; 0 = from vllm_gpu_memory_utilization (GPU), 1 (CPU)",
        min=0,
    )
    vllm_max_model_len: int = key(
        0,
        "vllm: longest prompt + response the engine accepts (its KV cache must hold one); 0 = "
        "data.max_prompt_length + generation.max_new_tokens, the longest a rollout samples",
        min=0,
    )
    vllm_sleep: bool = key(
        True,
        "vllm on GPU: free the engine's KV cache and offload its weights during the update "
        "(sleep mode), woken before the next rollout; CPU engines do not sleep",
    )
    vllm_enforce_eager: bool = key(
        False, "vllm on GPU: no CUDA graphs or compilation (faster start); CPU engines always eager"
    )
    tools: tuple[str, ...] = key(
        (),
        "multi-turn rollouts with tools (docs/agents.md): module:callable functions the policy "
        'may call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>; their JSON '
        "schemas (type hints + Args docstring, or a `schema` attribute) go to the chat template",
    )
    environment: str = key(
        "",
        "multi-turn rollouts with an environment (docs/agents.md): module:factory returning an "
        "object with reset(prompt) -> messages and step(messages) -> (new messages, done, "
        "reward or None); a fresh one per episode. Not together with generation.tools",
    )
    environment_endpoint: bool = key(
        False,
        "generation.environment drives the policy itself through the rollout servers' "
        "OpenAI-compatible chat endpoint (docs/agents.md): module:function(client, prompt, "
        "**row columns) -> reward or None, called once per episode with client.base_url, "
        "client.api_key, client.model and client.sampling; needs generation.backend=server",
    )
    endpoint_episodes_at_once: int = key(
        16, "generation.environment_endpoint: episodes played at once per trainer rank", gt=0
    )
    max_turns: int = key(
        4, "multi-turn rollouts: assistant turns per episode at most (then truncated)"
    )
    max_episode_tokens: int = key(
        0,
        "multi-turn rollouts: tokens after the prompt per episode at most, sampled turns and "
        "tool/environment messages together; 0 = max_turns x max_new_tokens",
    )
    tool_timeout_s: float = key(
        10.0, "multi-turn rollouts: seconds a tool call may run; then the model reads an error"
    )


@dataclass(frozen=True)
class RewardConfig:
    function: str = key(
        "",
        "module:callable taking (prompts, responses) -> list[float]; overrides model.reward. "
        "prompts are texts, or message lists for conversational data; responses are texts",
    )
    missing_eos_penalty: float | None = key(
        None, "replace the score of a response without EOS by this value (N+ study uses -1)"
    )
    normalize: bool = key(
        False,
        "running normalisation of scores (mean/std over all ranks, updated every iteration), "
        "after the missing-EOS penalty",
    )
    clip: float | None = key(
        None,
        "clip (normalised) scores to [-clip, clip], after the missing-EOS penalty; null = no",
        gt=0,
    )
    retries: int = key(
        2,
        "reward.function: calls that raise or time out are tried again this many times, "
        "with exponential backoff; then the run checkpoints its last completed iteration and "
        "stops (exit 2; continue with --resume auto). A reward model's forward is not retried",
        min=0,
    )
    retry_delay_s: float = key(
        1.0,
        "seconds before the first retry of reward.function; each further retry waits twice as long",
        min=0,
    )
    timeout_s: float | None = key(
        None,
        "reward.function: stop waiting for a call after this many seconds (a failure, retried); "
        "the call runs in a worker thread, which cannot be killed and is left behind; null = wait",
        gt=0,
    )
    functions: tuple[str, ...] = key(
        (),
        "several reward functions (module:callable each, as reward.function, or a reward "
        "model's path or hub id, scored by its head as model.reward): the score is "
        "sum_i weights[i] x f_i, each f_i logged as objective/score_<name> (docs/rewards.md); "
        "not with reward.function. Like reward.function, they replace model.reward as the score",
    )
    weights: tuple[float, ...] = key(
        (), "one weight per reward.functions entry; empty = all 1", finite=True
    )
    url: str = key(
        "",
        "remote reward model: POST {prompts, responses} -> {scores} to this URL, a reward "
        "component of weight reward.url_weight (protocol: docs/rewards.md)",
    )
    url_weight: float = key(1.0, "weight of the reward.url component", finite=True)
    remote_batch_size: int = key(
        32,
        "responses per reward.url request; concurrent requests to reward.judge_url; prompts "
        "per generation batch of a local judge",
        gt=0,
    )
    api_key_env: str = key(
        "",
        "name of the environment variable holding the API key for reward.url and "
        "reward.judge_url (sent as 'Authorization: Bearer ...'; the key itself is never "
        "logged or written); empty = no key",
    )
    judge: str = key(
        "none",
        "a generative judge as a reward component of weight reward.judge_weight, and eval's "
        "judge_win_rate: model = a local causal LM (reward.judge_model), url = an "
        "OpenAI-compatible chat-completions endpoint (reward.judge_url)",
        choices=("none", "model", "url"),
    )
    judge_model: str = key(
        "",
        "reward.judge=model: path of the judge causal LM (frozen, in model.dtype, replicated "
        "on every rank, greedy decoding)",
    )
    judge_url: str = key(
        "",
        "reward.judge=url: base URL of an OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1); "
        "requests go to <judge_url>/chat/completions",
    )
    judge_model_name: str = key("", "reward.judge=url: the 'model' field of each request")
    judge_template: str = key(
        "Rate the response to the prompt on a scale of 1 to 10, where 10 is best. "
        "Answer with the number only.\n\nPrompt: {prompt}\n\nResponse: {response}\n\nScore:",
        "the judge's prompt; {prompt} and {response} are replaced (a message-list prompt "
        "by its messages as 'role: content' lines); the first number of the reply is the score",
    )
    judge_max_new_tokens: int = key(8, "tokens the judge may write in its reply", gt=0)
    judge_fallback_score: float | None = key(
        0.0,
        "score of a judge reply without a number (counted as objective/judge_parse_failures); "
        "null = such a reply is a reward failure (the run stops as for reward.function)",
        finite=True,
    )
    judge_weight: float = key(1.0, "weight of the judge component", finite=True)

    def text_rewards(self) -> bool:
        """Whether scores come from text-reading rewards (reward.function(s), url, judge)
        rather than model.reward."""
        return bool(self.function or self.functions or self.url or self.judge != "none")


@dataclass(frozen=True)
class PPOConfig:
    iterations: int = key(100, "rollout + update rounds", gt=0)
    rollout_batch_size: int = key(64, "prompts per iteration, summed over all ranks", gt=0)
    samples_per_prompt: int = key(
        1,
        "responses sampled per prompt (n); an iteration has rollout_batch_size x n sequences, "
        "the n samples of a prompt always on one rank (group estimators need n >= 2)",
        gt=0,
    )
    estimator: str = key(
        "gae",
        "advantage estimator (rlhf_dist/algo/estimators.py): gae (with a critic), grpo, rloo, "
        "reinforce_pp, reinforce_pp_baseline (critic-free: no critic is built); distill: "
        "on-policy distillation from model.teacher alone, the task reward trains nothing "
        "(docs/distill.md); online_dpo: the DPO loss on each prompt's best and worst sample "
        "(needs samples_per_prompt >= 2; docs/online_dpo.md)",
        choices=tuple(ESTIMATORS),
    )
    grpo_std_normalize: bool = key(
        True,
        "grpo: divide by the group's reward std; false = Dr. GRPO (mean baseline only)",
        estimators=("grpo",),
    )
    rollout_micro_batch_size: int = key(
        64, "sequences per forward pass during rollout scoring and generation, per rank", gt=0
    )
    ppo_epochs: int | None = key(
        None,
        "passes over each rollout batch; null = 4 with a critic (gae, the N+ study), 1 for "
        "the critic-free estimators (with ppo.minibatch_size 0: one optimizer step per "
        "rollout, as TRL's GRPO)",
        gt=0,
    )
    minibatch_size: int = key(
        0,
        "sequences per optimizer step, summed over all ranks; 0 = the whole rollout "
        "(ppo.rollout_batch_size x ppo.samples_per_prompt)",
        min=0,
    )
    micro_batch_size: int = key(
        0,
        "sequences per forward/backward pass, per rank; 0 = the per-rank share of a "
        "minibatch in micro-batches of at most 8 (the largest divisor), so any world size "
        "that divides the minibatch works",
        min=0,
    )
    micro_batch_tokens: int = key(
        0,
        "token budget of one forward/backward pass, per rank: the update's rows longest first, cut so that rows x (longest prompt + longest response) stays within it (a longer row alone); every rank runs as many passes as the busiest; 0 = off "
        "(micro_batch_size rows)",
        min=0,
    )
    loss_aggregation: str = key(
        "token_mean",
        "how per-token losses make one loss: token_mean over all tokens of the minibatch, "
        "seq_mean_token_sum (per-sequence sums averaged; Dr. GRPO) or seq_mean_token_mean "
        "(per-sequence means averaged; GRPO's paper)",
        choices=LOSS_AGGREGATIONS,
    )
    optim: OptimConfig = key(
        OptimConfig(lr=3e-6), "optimizer of the actor (the policy); lr 3e-6 is the N+ study's at 1B"
    )
    critic_optim: OptimConfig = key(
        OptimConfig(lr=3e-6),
        "optimizer of the critic (the value model), when there is one",
        needs="critic",
    )
    critic_init: str = key(
        "reward",
        "the critic starts from the reward model or from the policy (with a new value head)",
        choices=("reward", "policy"),
        needs="critic",
    )
    clip_eps: float | None = key(
        0.2, "policy ratio clip; null turns clipping off (a debugging knob)", gt=0
    )
    clip_eps_low: float | None = key(
        None, "lower ratio clip 1 - clip_eps_low; null = clip_eps", gt=0, max=1
    )
    clip_eps_high: float | None = key(
        None,
        "upper ratio clip 1 + clip_eps_high (> clip_eps: DAPO's clip-higher); null = clip_eps",
        gt=0,
    )
    dual_clip: float | None = key(
        None,
        "dual-clip constant c > 1: a negative-advantage token's loss is at most -c*A; null = off",
        gt=1,
    )
    entropy_coef: float = key(
        0.0,
        "weight of the entropy bonus in the policy loss (aggregated like it); 0 = none; with "
        "ppo.entropy_target: the coefficient's starting value",
        min=0,
    )
    entropy_target: float | None = key(
        None,
        'adaptive entropy bonus (docs/algorithms.md, "Entropy control"): the mean per-token '
        "sampling entropy (nats, objective/entropy) to hold; after every iteration the "
        "coefficient moves by entropy_coef_lr x (target - entropy), within [0, "
        "entropy_coef_max], like SAC's temperature; null = ppo.entropy_coef stays fixed",
        gt=0,
    )
    entropy_coef_lr: float = key(
        0.01,
        "ppo.entropy_target: the coefficient's change per iteration per nat of entropy below "
        "(above) the target",
        gt=0,
    )
    entropy_coef_max: float = key(
        0.1, "ppo.entropy_target: the largest the adaptive coefficient may become", gt=0
    )
    cov_control: str = key(
        "none",
        "covariance-based entropy control (Cui et al. 2025): clip_cov stops the policy "
        "gradient of a random ppo.cov_ratio share of the tokens whose centred (log pi_old - "
        "mean)(A - mean) lies in (cov_clip_low, cov_clip_high); kl_cov adds cov_kl_coef x "
        "|log pi - log pi_old| to the share with the largest one; chosen once per rollout "
        'over all ranks (docs/algorithms.md, "Entropy control")',
        choices=COV_CONTROLS,
    )
    cov_ratio: float = key(
        2e-4,
        "ppo.cov_control: share of the trained tokens (over all ranks) chosen per rollout, at "
        "least one (2e-4: verl's default for both methods)",
        gt=0,
        max=0.1,
    )
    cov_clip_low: float = key(
        1.0,
        "cov_control=clip_cov: lower bound of the centred product of a candidate token",
        finite=True,
    )
    cov_clip_high: float = key(
        5.0,
        "cov_control=clip_cov: upper bound of the centred product of a candidate token",
        finite=True,
    )
    cov_kl_coef: float = key(
        1.0, "cov_control=kl_cov: weight of |log pi - log pi_old| on the chosen tokens", gt=0
    )
    ptx_coef: float = key(
        0.0,
        "PPO-ptx (InstructGPT eq. 2): weight of the token-mean NLL of a batch of data.ptx rows "
        "(ppo.minibatch_size rows per optimizer step, a seed-determined stream) added to the "
        "actor's loss; 0 = off",
        min=0,
    )
    rollout_correction: str = key(
        "none",
        "generation.backend=vllm or server: weight each trained token by the importance ratio "
        "r = pi_old / pi_rollout between the trainer's and the sampler's probabilities, bounded: "
        "tis min(r, high) (Yao et al. 2025), mis r * 1[r <= high] (masked: the tail dropped, "
        "Liu et al. 2025), icepop r * 1[low <= r <= high] per token (Ling Team 2025); none = off "
        '(docs/algorithms.md, "Rollout correction"; replaces ppo.tis_cap)',
        choices=ROLLOUT_CORRECTIONS,
    )
    decoupled: bool = key(
        False,
        "generation.backend=vllm or server: the decoupled PPO objective (AReaL, Fu et al. 2025): "
        "the trainer's log-probs before the update (pi_prox, the old log-probs) anchor the ratio "
        "and its clip, and each token's loss is weighted by pi_prox / pi_behav against the "
        "sampler's log-probs (maybe ppo.max_staleness updates old): raw with "
        "ppo.rollout_correction=none, else bounded by it (tis, mis = AReaL's cap, icepop); "
        'docs/algorithms.md, "Rollout correction"',
    )
    rollout_correction_level: str = key(
        "token",
        "ppo.rollout_correction's ratio: token (each token's own) or sequence (the row's "
        "product over its response tokens, on every token of the row; not for icepop)",
        choices=RATIO_LEVELS,
    )
    rollout_correction_low: float = key(
        0.5, "ppo.rollout_correction=icepop: tokens with r below this are masked", gt=0
    )
    rollout_correction_high: float = key(
        2.0,
        "ppo.rollout_correction: tis's cap on r, mis's and icepop's upper bound (r above it "
        "masked); typical 2",
        gt=0,
    )
    routing_replay: str = key(
        "none",
        "mixture-of-experts actors: replay a recorded top-k expert choice of every router "
        '(docs/moe.md, "Routing replay"); r2 = the routing of the rollout\'s scoring '
        "forward (the old policy's) in the update's forwards; r3 = the sampler's routing "
        "during generation (the decode loop, generation.backend=hf or server) in scoring "
        "and the update; none = off. The router weights stay the current softmax over the "
        "forced experts. A dense model is refused",
        choices=("none", "r2", "r3"),
    )
    max_staleness: int = key(
        0,
        "generation.backend=server: 0 = on-policy (sync the weights, sample, train); k >= 1 = "
        "the servers sample iterations i+1..i+k's rollouts (or play their episodes, with "
        "generation.environment_endpoint) while iteration i trains, each by the weights "
        "iteration i started with (k steps off-policy, never across a scheduled checkpoint; a "
        "rollout more than k updates old is never trained on). k > 1 overlaps more than 1 "
        "with one trainer process (its syncs queued behind the requests from host snapshots "
        'of the weights); docs/serving.md, "Asynchronous rollouts"',
        min=0,
    )
    partial_rollouts: bool = key(
        False,
        "ppo.max_staleness >= 1 with generation.backend=server: the trainer's weight syncs "
        "reach the servers while they generate; a response still decoding continues under "
        "the new weights from the next decode step (its KV cache recomputed), each token "
        "keeping the version and behaviour log-prob it was sampled with (PipelineRL; not "
        'bitwise reproducible: docs/serving.md, "Partial rollouts")',
    )
    ratio_level: str = key(
        "token",
        "importance ratio of the policy loss: token (PPO's pi/pi_old per token) or sequence "
        "(GSPO, Zheng et al. 2025: the row's length-normalised ratio exp(mean_t log pi/pi_old) "
        "on every token, gradients per token; GSPO's paper pairs it with "
        "loss_aggregation=seq_mean_token_mean and a small clip_eps)",
        choices=RATIO_LEVELS,
    )
    policy_loss: str = key(
        "clip",
        "policy loss: clip (PPO's clipped surrogate) or cispo (MiniMax-M1 2025: "
        "-sg[clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high)] * A * logprob, every token keeps "
        "a gradient; clip_eps_low=1 is MiniMax's upper bound only; no dual_clip)",
        choices=POLICY_LOSSES,
    )
    dynamic_sampling: bool = key(
        False,
        "DAPO dynamic sampling (Yu et al. 2025): drop prompt groups whose n scores all tie "
        "(no group-baseline signal) and roll out more prompts until every rank's batch is "
        "full; needs a group estimator (grpo, rloo, reinforce_pp_baseline)",
    )
    dynamic_sampling_max_rounds: int = key(
        3,
        "dynamic sampling: extra rollout rounds per iteration at most (all ranks run the same "
        "number); a batch still short after them is topped up with tied groups",
        min=1,
    )
    overlong: str = key(
        "none",
        "DAPO's overlong handling of truncated responses (no stop token within "
        "generation.max_new_tokens): none; mask (they are left out of the loss); soft (the "
        "length penalty of DAPO eq. 13 over the last overlong_buffer tokens is added to the score)",
        choices=OVERLONG,
    )
    overlong_buffer: int = key(
        4,
        "overlong=soft: L_cache, the last tokens before generation.max_new_tokens over which "
        "the penalty falls from 0 to -1",
    )
    value_clip_eps: float | None = key(
        0.2,
        "clip of the value update around the rollout's values; null = off",
        gt=0,
        needs="critic",
    )
    vf_coef: float = key(0.1, "weight of the value loss", needs="critic")
    gamma: float = key(
        1.0,
        "discount of GAE and of REINFORCE++'s return-to-go",
        min=0,
        max=1,
        estimators=("gae", "reinforce_pp", "reinforce_pp_baseline"),
    )
    lam: float = key(0.95, "lambda of GAE", min=0, max=1, needs="critic")
    kl_coef: float = key(
        0.05,
        "weight of the per-token KL to the reference (initial, if adaptive); 0 = no KL term and "
        "no reference model loaded (TRL's GRPO default); with ppo.estimator=online_dpo it is "
        "DPO's beta (> 0)",
        min=0,
    )
    kl_placement: str = key(
        "reward",
        "where the KL to the reference acts: reward (a per-token penalty in the rewards, "
        "InstructGPT) or loss (kl_coef x the kl_kind estimate added to the policy loss, GRPO)",
        choices=("reward", "loss"),
    )
    kl_kind: str = key(
        "k1",
        "estimator of the per-token KL to the reference (Schulman 2020): k1 = log ratio, "
        "k2 = its square / 2, k3 = exp(-d) + d - 1",
        choices=KL_KINDS,
    )
    kl_controller: str = key(
        "fixed",
        "fixed kl_coef, or adaptive: steered towards ppo.kl_target (Ziegler et al. 2019)",
        choices=("fixed", "adaptive"),
    )
    kl_target: float = key(
        6.0, "adaptive controller: KL per response to steer towards (nats)", gt=0
    )
    kl_horizon: float = key(
        10000.0, "adaptive controller: its horizon (how slowly it adapts)", gt=0
    )
    distill_coef: float = key(
        1.0,
        "with model.teacher: weight of the distillation signal, added to the estimator's "
        "advantages (distill_loss=reverse_kl) or to the loss (gjsd); with a task estimator "
        "(grpo, ...) it mixes distillation with the task reward (docs/distill.md)",
        min=0,
    )
    distill_loss: str = key(
        "reverse_kl",
        "with model.teacher: reverse_kl = log pi_teacher - log pi_old of each sampled token as "
        "its advantage in the policy-gradient loss, no discounting (Thinking Machines 2025); "
        "gjsd = GKD's generalised JSD over the whole vocabulary at each sampled position, a "
        "loss term (Agarwal et al. 2024; the teacher runs again in the update)",
        choices=DISTILL_LOSSES,
    )
    distill_beta: float = key(
        0.5,
        "distill_loss=gjsd: GKD's beta, the mixture M = beta teacher + (1 - beta) student; "
        "0 = forward KL(teacher || student), 1 = reverse KL(student || teacher)",
        min=0,
        max=1,
    )
    dpo_loss: str = key(
        "sigmoid",
        "ppo.estimator=online_dpo: the DPO loss on each prompt's (best, worst) pair of samples "
        "against the reference, with beta = ppo.kl_coef: sigmoid (Rafailov et al. 2023) or "
        "ipo (Azar et al. 2023) (docs/online_dpo.md)",
        choices=ONLINE_DPO_LOSSES,
        estimators=("online_dpo",),
    )
    whiten_advantages: bool | None = key(
        None,
        "normalise advantages to mean 0, std 1 (statistics over all ranks); null = the "
        "estimator's rule: on for gae and reinforce_pp*, off for grpo and rloo",
    )


@dataclass(frozen=True)
class EvalConfig:
    reference: str = key(
        "", "reference policy for the KL figure; empty: the run's model.policy has none"
    )
    num_prompts: int = key(128, "held-out prompts scored at most", gt=0)
    batch_size: int = key(64, "prompts per generation batch, per rank", gt=0)
    gold_function: str = key(
        "",
        "optional oracle module:callable(prompts, responses, finished) -> list[float], "
        "e.g. the demo task's gold reward, reported as gold_reward",
    )


@dataclass(frozen=True)
class IterateConfig:
    rounds: int = key(2, "rlhf-dist iterate: rounds of sample pairs -> label -> RM -> PPO", gt=0)
    labeller: str = key(
        "gold",
        "who labels each sampled pair: gold = Bradley-Terry labels on eval.gold_function at "
        "iterate.label_beta (the demo's oracle); or module:function(prompt, a, b) returning "
        "True/False (a preferred / b preferred) or P(a preferred) in [0, 1], drawn as a label "
        "(docs/iterate.md)",
    )
    label_beta: float = key(
        10.0, "labeller=gold: P(a preferred) = sigmoid(label_beta x (gold(a) - gold(b)))", gt=0
    )
    rm_init: str = key(
        "continue",
        "each round's reward model starts from the last round's (continue; round 1 from "
        "model.reward if set, else model.policy) or afresh from model.policy (fresh)",
        choices=("continue", "fresh"),
    )
    pairs_per_round: int = key(
        256, "answer pairs sampled from the current policy on data.train prompts each round", gt=0
    )
    heldout_pairs: int = key(
        128,
        "labelled pairs sampled from each round's final policy on data.eval prompts, for "
        "rm_accuracy_on_this_policy / _on_previous_policy",
        gt=0,
    )
