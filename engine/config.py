"""The recipe: typed, validated all at once, every problem reported in one message.

A recipe is a YAML file with five sections (model, data, train, checkpoint, grpo), each a dataclass below, and the
top-level run_dir and resume.
Command-line overrides (--max_steps, --data, ...) are applied before validation, so a bad override is
reported like a bad YAML value.
"""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

RECIPES = Path(__file__).resolve().parent / "recipes"
ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_RECIPE = RECIPES / "tiny.yaml"


class ConfigError(ValueError):
    """Bad user input. The message is the whole story: what, where, how to fix."""


@dataclass
class ModelConfig:
    arch: str = "deepseek_v3"
    """The model family: deepseek_v3, deepseek_v2, qwen3_moe, qwen3_5_moe (its text-only causal LM) or mixtral. With
    init_from, the family and every size below come from that directory's config.json."""
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    """Key/value heads (qwen3_moe, mixtral, qwen3_5_moe; the DeepSeek families use MLA and ignore it)."""
    intermediate_size: int = 128
    """Width of dense MLP layers (deepseek_v3's first_dense_layers)."""
    moe_intermediate_size: int = 64
    num_experts: int = 8
    experts_per_token: int = 2
    num_shared_experts: int = 1
    """Shared experts of each MoE layer (deepseek_v3, deepseek_v2, qwen3_5_moe: one block of this many x
    moe_intermediate_size). qwen3_moe and mixtral have none: there more than 1 is refused, 0 or 1 mean none."""
    first_dense_layers: int = 0
    """deepseek_v3, deepseek_v2: how many leading layers use a dense MLP instead of MoE."""
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    kv_lora_rank: int = 32
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 8
    qk_nope_head_dim: int = 16
    v_head_dim: int = 16
    rope_theta: float = 10000.0
    init_from: str | None = None
    """A Hugging Face model directory to load weights from (ZeRO-3-aware) instead of random init; its config.json
    gives the family and sizes (the fields above are replaced by its values)."""
    attn_implementation: str = "sdpa"
    """transformers attention kernel: sdpa (PyTorch's fused attention), eager, or flex_attention."""


@dataclass
class DataCurriculumConfig:
    """The order of the documents in the first epoch of pretraining (engine/curriculum.py: document_order)."""
    mode: str = "none"
    """none (windows shuffled by the seed) | length (documents short to long, in tokens) | score (by score_column,
    low to high). Ordered documents are packed in that order and the first epoch reads the windows in it (later
    epochs are shuffled as without a curriculum); ties keep a seeded random order. Map-style data only."""
    score_column: str | None = None
    """mode score: a numeric column of data.path (e.g. a difficulty)."""
    reverse: bool = False
    """Long to short, or high to low score."""


@dataclass
class DataConfig:
    path: str = str(ASSETS / "corpus.jsonl")
    """A local .jsonl/.json/.parquet/.txt file, a folder of them, or a hub dataset name."""
    text_field: str = "text"
    tokenizer: str = "auto"
    """A tokenizer directory or hub name. auto: the tokenizer saved with the model the run starts from, where it has
    one (model.init_from's directory; in GRPO also --init_from's: a Hugging Face directory's own files, or a
    pretraining checkpoint's tokenizer/), else the bundled 512-token one (engine/assets/tokenizer)."""
    seq_len: int = 128
    streaming: bool = False
    """Stream and tokenize on the fly instead of tokenizing everything up front."""
    split: str = "train"
    name: str | None = None
    """A hub dataset's configuration (datasets.load_dataset's `name`, e.g. wikitext-103-raw-v1); local data: unset."""
    curriculum: DataCurriculumConfig = field(default_factory=DataCurriculumConfig)
    """Pretraining only: order the first epoch's documents (short to long, or by a score column)."""
    seed: int | None = None
    """The order of the training windows (the shuffle, and ties in a curriculum); null: train.seed. Another value with
    the same train.seed trains the same initial model on another data order (a run-to-run noise floor)."""


@dataclass
class TrainConfig:
    max_steps: int = 200
    lr: float = 3e-3
    """Peak learning rate; fills the DS config's optimizer lr when that says "auto"."""
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    """Cosine decays the DS config's optimizer lr to lr * min_lr_ratio at decay_steps (max_steps when unset)."""
    decay_steps: int | None = None
    """Length of the LR schedule (linear warmup, then cosine to lr * min_lr_ratio, then flat); null: max_steps. A
    --resume with another max_steps keeps the schedule the checkpoint was trained with; set this to change it."""
    seed: int = 1234
    log_every: int = 10
    balance_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3): per-step update of each expert's routing bias. 0 = off."""
    activation_checkpointing: bool | str = "auto"
    """Recompute each decoder layer's activations in backward: about 1/3 more compute, far less memory. auto, with a
    DS config's "auto" batch on a GPU: on where nothing fits without it, or where it lets a micro-batch hold at least
    4 times the rows and without it a micro-batch would hold fewer than 4096 tokens (GRPO) or 16,384 tokens under
    ZeRO-3 (pretraining; ZeRO-1/2 pretraining: off) (engine/auto_batch.py); off otherwise."""
    tokens_per_step_per_gpu: int | None = None
    """Target tokens per optimizer step per data-parallel rank, for a DS config's gradient_accumulation_steps "auto"
    (accumulation = this / (micro-batch x data.seq_len), rounded, at least 1). Unset: 64 x data.seq_len on an
    accelerator, one micro-batch (accumulation 1) on the CPU (docs/configs.md)."""
    fp8: bool | str = False
    """false | dense: the attention projections, shared experts and dense MLPs in FP8 through torchao's Float8Linear
    (engine/fp8.py; pip install -e ".[fp8]"); the output layer, routers and routed experts stay in the model's dtype;
    weights, checkpoints and exports are unchanged. all: the routed experts too, through torchao's FP8 rowwise grouped
    GEMM (AutoEP's experts; the output layer and routers stay in the model's dtype)."""
    stochastic_rounding: bool | str = "auto"
    """With bf16 master weights (DS config bf16.bf16_master_weights_and_grads, e.g. ds_configs/zero2_bf16_states.json)
    AdamW runs as engine/optim.py's AdamWSR: the update computed in fp32, the new bf16 weight rounded up or down at
    random in proportion (unbiased), so updates below half a bf16 step (|w| / 512) still land on average; DeepSpeed's
    own optimizer rounds to nearest and drops them. auto: on wherever the DS config keeps bf16 master weights with an
    Adam/AdamW on the GPU (no optimizer offload), otherwise off. true: required (refused where it cannot apply).
    false: DeepSpeed's optimizer as configured."""
    compile: bool | str = "auto"
    """Pretraining: auto compiles the decoder layers on CUDA wherever they can be compiled whole: under ZeRO stage 1-2
    with AutoEP, no offload, no pipeline, through DeepSpeed (engine.compile() with the DS config's "compile":
    {"autoep_non_moe": true}: routing and experts eager); under ZeRO-3 with AutoEP and decoder-layer leaves
    (zero_optimization.leaf_module "auto", as shipped) each layer's forward in the engine, AutoEP eager, DeepSpeed's
    hooks around the layer (engine/pretrain.py compile_layers); under other ZeRO-3 files on CUDA only the layers'
    parameter-free functions (RMSNorm's arithmetic, silu(gate) * up, rotary: engine/model.py compile_parameter_free);
    off otherwise. Where auto compiles whole layers it leaves linear-attention mixers (Qwen3.5's Gated DeltaNet) eager
    (engine/pretrain.py eager_linear_attention). true: as auto where the layers can be compiled whole, the mixers too (ZeRO-3 leaves without AutoEP included),
    refused elsewhere. false: never. bin/grpo.py: true compiles the policy's decoder layers, AutoEP eager, for any
    sequence length (compile_layers with dynamic shapes); auto does so on CUDA under ZeRO-3 with AutoEP and
    decoder-layer leaves with grpo.rollout local, linear attention eager (engine/grpo.py policy_compiles_layers),
    and elsewhere on CUDA compiles the policy's parameter-free functions (layers eager: under ZeRO-1/2 their compile
    did not pay, and DeepSpeed's whole-layer compile of ZeRO 1-2 pretraining does not serve GRPO's changing
    lengths). The one-GPU reference copy (no-grad passes included) compiles its parameter-free functions wherever
    the policy compiles anything; its layers stay eager. Measured: docs/benchmarks.md."""


@dataclass
class TreeConfig:
    """grpo.tree: tree rollouts (TreeRL's EPTree, arXiv 2506.11902; engine/tree.py). Per prompt: `trees` chains are
    sampled; then, `iterations` times, each tree's `branch_points` highest-entropy tokens (over its paths' generated
    tokens, never a path's last one nor one already branched) each start `branches` new paths that resample that
    token and continue to EOS or max_new_tokens, the prefix's KV cache forked, not recomputed. A prompt's leaves,
    trees x (1 + iterations x branch_points x branches), are its group (grpo.group_size is not used); each token's
    advantage is (global + local) / sqrt(leaves below it), docs/grpo.md."""
    enabled: bool = False
    trees: int = 2
    """M: chains sampled per prompt, each the root path of a tree."""
    branch_points: int = 1
    """N: tokens branched from per tree per iteration."""
    branches: int = 3
    """B: new paths from each branch point."""
    iterations: int = 1
    """T: rounds of branching (a later round can branch from paths of an earlier one)."""
    segment_len: int | None = None
    """L: iteration t (1-based) branches only at response offsets [(t-1) x L, t x L), so the trees deepen round by
    round; null: anywhere in the paths."""

    def leaves(self) -> int:
        return self.trees * (1 + self.iterations * self.branch_points * self.branches)


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Save every N optimizer steps (0 = only at the end)."""
    every_minutes: float = 0.0
    """Also save when this many minutes have passed since the last save (0 = never by time)."""
    keep_last: int = 2
    """Keep the newest N complete checkpoints; older ones are removed after each save."""
    at_end: bool = True
    """Also save after the last step."""


@dataclass
class CurriculumConfig:
    """grpo.curriculum: which prompts each step draws, from their pass rates so far (engine/curriculum.py).

    Per prompt: attempts, passes (completions whose total reward >= pass_threshold) and the reward sum, over all
    ranks. Each step draws its global batch of prompts: unseen_share x batch (rounded half up) from prompts never tried
    (uniformly), the rest from tried ones with weight 1 when the pass rate estimate (passes / attempts) lies in
    `band`, `outside_weight` when it does not (always or never solved: sampled rarely, never starved), without
    replacement. Too few tried prompts: the rest is unseen ones; too few unseen: the rest is tried ones."""
    enabled: bool = False
    band: list = field(default_factory=lambda: [0.2, 0.8])
    """[low, high]: pass rates (inclusive) that get full weight; 0 <= low <= high <= 1."""
    unseen_share: float = 0.25
    """Share of each step's prompts drawn from prompts not tried yet, while there are any."""
    outside_weight: float = 0.1
    """Weight of a tried prompt whose pass rate is outside the band, against 1 inside it; in (0, 1]."""
    pass_threshold: float = 1.0
    """A completion passes when its total reward (the weighted sum of grpo.rewards) is >= this. 1.0: the numeric
    reward's full score at weight 1 (a format reward of 0.5 alone does not pass)."""
    decay: float = 0.5
    """When a prompt is drawn again its earlier counts are first multiplied by this, so the estimate follows the
    policy as it learns; 1.0 keeps every attempt at full weight. In [0, 1]."""


@dataclass
class GRPOConfig:
    """GRPO (bin/grpo.py). Per step each rank takes micro_batch x grad_accum / group_size prompts from the DS
    config's batch sizes, samples group_size completions of each, and makes `iterations` optimizer steps."""
    group_size: int = 8
    """G: completions per prompt (>= 2: advantages compare a completion with its group)."""
    max_new_tokens: int = 8
    min_new_tokens: int = 0
    """EOS cannot be sampled before this many new tokens (transformers' min_new_tokens). For benchmarks that need
    equal-length completions (= max_new_tokens: every completion full length); the loss scores the unmasked
    distribution, so leave it 0 for training. Chain rollouts of the local decoder only."""
    temperature: float = 1.0
    top_p: float = 1.0
    iterations: int = 1
    """Optimizer steps per rollout batch; the rollout's log-probs are the old policy for all of them."""
    clip_low: float = 0.2
    clip_high: float = 0.28
    beta: float = 0.0
    """KL weight; 0 builds no reference engine."""
    kl: str = "k3"
    aggregation: str = "grpo"
    """grpo | dapo | dr_grpo: how token losses become the batch loss (engine/grpo_math.py). dr_grpo is Dr. GRPO's
    aggregation only; its std-free advantages are normalize_std: false, set apart."""
    normalize_std: bool = True
    """Divide each group's advantages by the group's reward std (GRPO); false: mean-centred only (Dr. GRPO)."""
    rollout_correction: str = "none"
    """none | tis | mis: correct the policy gradient for the rollout/train mismatch with the rollout decoder's own
    log-probs (engine/grpo_math.py: GRPOLossConfig). Local chain rollouts only."""
    rollout_correction_cap: float = 2.0
    """tis: weights are truncated to it; mis: tokens whose weight exceeds it are masked."""
    routing_replay: str = "off"
    """off | r3: the policy's training forwards dispatch every token (prompt and response) to the experts the rollout
    decoder chose for it, with gate weights from the live router (engine/routing.py). Local decoder only."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (DAPO): they carry no signal."""
    tree: TreeConfig = field(default_factory=TreeConfig)
    """Tree rollouts instead of independent chains (enabled: true turns them on with these defaults)."""
    rewards: list = field(default_factory=lambda: [{"name": "numeric", "weight": 1.0, "which": "first"}])
    allow_random_init: bool = False
    """Train a randomly initialised policy when there is no --init_from / model.init_from (benchmarks); otherwise
    that is refused: a random policy earns no reward and learns nothing."""
    rollout: str = "auto"
    """local (a gathered copy of the policy on each device, when it fits) | engine (through DeepSpeed) | auto."""
    decode_experts: str = "auto"
    """MoE kernel of the rollout decoder: auto (dense on CUDA, grouped_mm elsewhere) | dense (every expert on every
    token, weighted by the routing: all experts' weights read in two full-width GEMMs; on one H200, grpo_2b6 at
    batch 64: 2.81 ms per decode step against grouped_mm's 3.32, bin/decode_bench.py) | grouped_mm (each
    expert's weights read once per token step by a grouped GEMM) | batched_mm (copies every token's top-k expert
    weights) | eager."""
    decode_attention: str = "auto"
    """Attention of the rollout decoder's DeepSeek (MLA) layers at each decode step: auto (triton on CUDA where the
    triton package is installed, torch elsewhere) | torch (the absorbed MLA's batched GEMMs and softmax) | triton
    (one kernel per layer: scores, online softmax and the weighted sum of the latent cache, engine/mla_decode.py;
    CUDA only)."""
    eval_path: str | None = None
    """Held-out prompts (jsonl with prompt/answer), scored greedily at eval_every steps."""
    eval_every: int = 10
    prompts_per_step_per_gpu: int | None = None
    """Prompts each GPU samples a step (x group_size completions each: the rollout batch per GPU). With the DS
    config's batch "auto" (ds_configs/zero2.json, zero3.json) the micro-batch is fitted to the device's memory and
    the accumulation makes up this batch; null there: 64 // group_size prompts (64 sequences). With numbers in the
    DS config the batch is micro x accumulation sequences, and this, if set, must agree with it."""
    max_generated_tokens: int | None = None
    """Stop after the step at which the run's generated tokens (the metrics' `generated_tokens`, summed over steps
    and ranks) reach this, even before train.max_steps; that step is evaluated and saved (checkpoint.at_end) as a
    last step is. For comparing rollout kinds at an equal generation budget; null: train.max_steps alone."""
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """Draw prompts by their pass rates so far (enabled: true turns it on with these defaults)."""


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    run_dir: str = "runs/default"
    resume: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def data_seed(self) -> int:
        """The seed of the data order: data.seed, else train.seed."""
        return self.train.seed if self.data.seed is None else self.data.seed


# model.arch -> the Hugging Face model_type it is built as (qwen3_5_moe: the text-only causal LM of Qwen3.5-MoE)
HF_MODEL_TYPES = {"deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v2", "qwen3_moe": "qwen3_moe",
                  "qwen3_5_moe": "qwen3_5_moe_text", "mixtral": "mixtral"}
ARCHS = tuple(HF_MODEL_TYPES)
# ModelConfig field -> the Hugging Face config attributes that hold it, first present wins (model.init_from)
FROM_HF = {"hidden_size": ("hidden_size",), "num_layers": ("num_hidden_layers",), "num_heads": ("num_attention_heads",),
           "num_kv_heads": ("num_key_value_heads", "num_attention_heads"), "vocab_size": ("vocab_size",),
           "max_position_embeddings": ("max_position_embeddings",),
           "num_experts": ("n_routed_experts", "num_local_experts", "num_experts"),
           "experts_per_token": ("num_experts_per_tok",), "first_dense_layers": ("first_k_dense_replace",),
           "intermediate_size": ("intermediate_size",), "kv_lora_rank": ("kv_lora_rank",),
           "q_lora_rank": ("q_lora_rank",), "qk_rope_head_dim": ("qk_rope_head_dim",),
           "qk_nope_head_dim": ("qk_nope_head_dim",), "v_head_dim": ("v_head_dim",)}
ATTN = ("sdpa", "eager", "flex_attention")


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _fill(cls: type, raw: Any, where: str, problems: list[str]) -> Any:
    """Build dataclass `cls` from a dict, collecting (not raising) every problem."""
    obj = cls()
    if raw is None:
        return obj
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping, got {type(raw).__name__}")
        return obj
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key, value in raw.items():
        path = f"{where}.{key}" if where else key
        if key in known and hints[key] is str and isinstance(value, bool) and getattr(obj, key) == "off":
            value = "on" if value else "off"  # YAML 1.1 reads a bare off/on as a boolean (grpo.routing_replay: off)
        if key not in known:
            problems.append(f"{path}: unknown key (known: {', '.join(sorted(known))})")
        elif dataclasses.is_dataclass(hints[key]):
            setattr(obj, key, _fill(hints[key], value, path, problems))
        elif ((isinstance(value, float) or hints[key] is float and isinstance(value, str) and _is_number(value))
              and not math.isfinite(float(value))):
            problems.append(f"{path}: must be a finite number, got {value}")  # NaN passes every < and > check
        elif hints[key] is float and isinstance(value, str) and _is_number(value):
            setattr(obj, key, float(value))  # YAML 1.1 reads 3e-4 (no dot) as a string
        elif not _type_ok(value, hints[key]):
            problems.append(f"{path}: expected {_type_name(hints[key])}, got {value!r}")
        else:
            setattr(obj, key, float(value) if hints[key] is float else value)
    return obj


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def tree_problems(g: "GRPOConfig") -> list[str]:
    """grpo.tree: counts >= 1 always; whether the tree fits max_new_tokens when enabled."""
    t, p = g.tree, []
    for name, why in (("trees", "chains sampled per prompt"), ("branch_points", "tokens branched from per tree and "
                      "iteration"), ("branches", "new paths from each branch point"), ("iterations", "rounds of "
                      "branching; without any, set grpo.tree.enabled: false")):
        if getattr(t, name) < 1:
            p.append(f"grpo.tree.{name} ({getattr(t, name)}) must be >= 1: {why}")
    if t.segment_len is not None and t.segment_len < 1:
        p.append(f"grpo.tree.segment_len ({t.segment_len}) must be >= 1 (or null: branch anywhere)")
    if not t.enabled or p:
        return p
    if g.max_new_tokens < 2:
        p.append(f"grpo.tree needs grpo.max_new_tokens >= 2, got {g.max_new_tokens}: a path's last token is never a "
                 "branch point")
    elif t.segment_len is not None and t.iterations * t.segment_len > g.max_new_tokens - 1:
        p.append(f"grpo.tree: iterations x segment_len = {t.iterations} x {t.segment_len} = "
                 f"{t.iterations * t.segment_len} response tokens to branch in, but a path of grpo.max_new_tokens "
                 f"{g.max_new_tokens} has at most {g.max_new_tokens - 1} (its last token is never a branch point); "
                 "lower iterations or segment_len, or raise max_new_tokens")
    return p


def bundled(p):
    """A relative path into the engine's bundled files (`engine/assets/...`, as the shipped recipes name their data
    from the checkout's root) found from any working directory, also when the engine is installed (`pip install .`)
    and the working directory holds no `engine/`; `~/...` is the user's home, as in a shell (a YAML file is read by
    no shell, and transformers would take "~/model" for a hub name). Any other path is kept as given."""
    if isinstance(p, str) and p.startswith("~"):
        return str(Path(p).expanduser())
    if not isinstance(p, str) or not p.startswith("engine/") or Path(p).exists():
        return p
    found = ASSETS.parent.parent / p
    return str(found) if found.exists() else p


BUNDLED_TOKENIZER = str(ASSETS / "tokenizer")


def hf_tokenizer(model_dir: str | None) -> str | None:
    """The tokenizer saved in a Hugging Face model directory (data.tokenizer auto): the directory, where it holds
    tokenizer files; None otherwise."""
    p = Path(model_dir) if model_dir else None
    return str(p) if p and any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")) else None


def load_recipe(path: str | Path | None = None, overrides: dict | None = None) -> Recipe:
    """Read a recipe YAML (default: the embedded tiny recipe), apply overrides, validate everything."""
    path = Path(path) if path else DEFAULT_RECIPE
    if not path.is_file():
        raise ConfigError(f"recipe {path}: no such file (pass --config PATH to a recipe YAML)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"recipe {path}: not valid YAML{at} ({what})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"recipe {path}: expected a mapping of sections (model:, train:, data:, ...), got "
                          f"{type(raw).__name__}")
    for dotted, value in (overrides or {}).items():  # "train.max_steps", "grpo.tree.enabled"
        *sections, key = dotted.split(".")
        target = raw
        for name in sections:  # an empty section (`train:` with nothing under it) reads as None: filled
            if isinstance(target, dict) and target.get(name) is None:
                target[name] = {}
            target = target.get(name) if isinstance(target, dict) else None
        if isinstance(target, dict):  # else the section is not a mapping, which validation names
            target[key] = value
    problems: list[str] = []
    recipe = _fill(Recipe, raw, "", problems)
    given = (raw.get("model") if isinstance(raw, dict) else None) or {}
    if (isinstance(given, dict) and given.get("arch") in ("qwen3_moe", "mixtral") and not given.get("init_from")
            and isinstance(given.get("num_shared_experts"), int) and given["num_shared_experts"] > 1):  # 1: the default
        problems.append(f"model.num_shared_experts: {given['arch']} has no shared experts (transformers builds none); "
                        "remove the key, or use deepseek_v3 or qwen3_5_moe for a model with them")
    if isinstance(recipe.data, DataConfig) and isinstance(recipe.grpo, GRPOConfig):
        recipe.data.path, recipe.data.tokenizer = bundled(recipe.data.path), bundled(recipe.data.tokenizer)
        recipe.grpo.eval_path = bundled(recipe.grpo.eval_path)
    if isinstance(recipe.model, ModelConfig):
        recipe.model.init_from = bundled(recipe.model.init_from)
    recipe.run_dir = bundled(recipe.run_dir)
    if recipe.model.init_from is not None:
        problems += model_from_hf_dir(recipe.model) or hf_weights_problems(recipe.model.init_from)
        if isinstance(recipe.data, DataConfig) and recipe.data.tokenizer == "auto":
            recipe.data.tokenizer = hf_tokenizer(recipe.model.init_from) or "auto"
    problems += validate(recipe)
    if problems:
        e = ConfigError(f"recipe {path}: " + "; ".join(problems))
        # what preflight can still check: the sections named by no problem (engine/pretrain.py checks the data)
        e.recipe = recipe if isinstance(raw, dict) else None
        e.sections = {q.split(".")[0].split(":")[0] for q in problems}
        raise e
    return recipe


HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def weights_problem(d: Path) -> str | None:
    """What is missing from a Hugging Face model directory's weights (None: a weights file, and every shard its index
    names): a save cut short can leave config.json alone, which transformers only reports in a traceback on every
    rank after the engine started."""
    found = [f for f in HF_WEIGHT_FILES if (d / f).is_file()]
    if not found:
        return (f"no weights next to config.json (none of {', '.join(HF_WEIGHT_FILES)}; a save that was cut short "
                "leaves config.json alone): save the model again, or point at a complete model directory")
    if found[0].endswith(".index.json"):
        try:
            shards = sorted(set(json.loads((d / found[0]).read_text())["weight_map"].values()))
            if not all(isinstance(s, str) for s in shards):
                raise TypeError("a shard name that is not a string")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{found[0]} is not a weights index (a JSON object with a weight_map: {type(e).__name__} {e})"
        gone = [s for s in shards if not (d / s).is_file()]
        if gone:
            return (f"{found[0]} names {len(gone)} shard file(s) that are not there ({', '.join(gone[:3])}"
                    f"{', ...' if len(gone) > 3 else ''}): copy them in, or save the model again")
    else:
        shards = [found[0]]
    for name in shards:
        if name.endswith(".safetensors"):
            cut = safetensors_problem(d / name)
            if cut:
                return f"{name} {cut}: copy it again, or save the model again"
    return None


def safetensors_problem(path: Path) -> str | None:
    """Whether a safetensors file is whole, from its header alone (8 bytes of length, a JSON table of tensors and
    their byte ranges): a copy or download cut short, which transformers reports in a traceback on every rank."""
    import struct

    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if 8 + n > size:
                raise ValueError
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return f"is not a readable safetensors file ({size:,} bytes, its header cut or damaged)"
    if 8 + n + end > size:
        return f"is cut short: {size:,} of the {8 + n + end:,} bytes its header describes"
    return None


def hf_weights_problems(init_from: str) -> list[str]:
    """model.init_from's weights_problem as the recipe's problem line (none when the weights are all there)."""
    missing = weights_problem(Path(init_from))
    return [f"model.init_from {init_from}: {missing}"] if missing else []


def model_from_hf_dir(m: ModelConfig) -> list[str]:
    """model.init_from: set the family and sizes from the directory's config.json (a user's checkpoint needs no
    architecture fields in the recipe); returns what is wrong with it, each in one line. Reads config.json only:
    whether the weights are there is hf_weights_problems' (GRPO's "auto" reads a config-only temporary dir here)."""
    where = f"model.init_from {m.init_from}"
    if not Path(m.init_from, "config.json").is_file():
        return [f"{where}: not a Hugging Face model directory (no config.json)"]
    try:
        model_type = json.loads(Path(m.init_from, "config.json").read_text()).get("model_type")
    except (ValueError, AttributeError) as e:
        return [f"{where}: config.json is not a JSON object ({e})"]
    families = {v: k for k, v in HF_MODEL_TYPES.items()}
    if model_type == "qwen3_5_moe":
        return [f"{where}: model_type qwen3_5_moe is the Qwen3.5-MoE vision-language model; the engine trains its "
                "text-only causal LM (model_type qwen3_5_moe_text): save the language model on its own "
                "(Qwen3_5MoeForCausalLM with the config's text_config) and point init_from there"]
    if model_type not in families:
        return [f"{where}: model_type {model_type!r} is not a supported family (supported model_type values: "
                f"{', '.join(families)})"]
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(m.init_from)
    except Exception as e:  # noqa: BLE001  (transformers raises many kinds for a bad config)
        return [f"{where}: transformers cannot read its config.json ({type(e).__name__}: {str(e).splitlines()[0]})"]
    m.arch = families[model_type]
    for name, attrs in FROM_HF.items():
        value = next((getattr(cfg, a) for a in attrs if getattr(cfg, a, None) is not None), None)
        if value is not None or name == "q_lora_rank" and hasattr(cfg, "q_lora_rank"):
            setattr(m, name, value)
    if m.arch == "mixtral":
        m.moe_intermediate_size, m.num_shared_experts = cfg.intermediate_size, 0
    else:
        m.moe_intermediate_size = cfg.moe_intermediate_size
        m.num_shared_experts = (getattr(cfg, "n_shared_experts", None) or 0 if m.arch.startswith("deepseek")
                                else int(bool(getattr(cfg, "shared_expert_intermediate_size", 0))))
    if m.arch.startswith("deepseek") and m.num_kv_heads != m.num_heads:
        return [f"{where}: config.json has num_key_value_heads {m.num_kv_heads} but num_attention_heads {m.num_heads}; "
                f"{m.arch}'s attention (MLA) has one key/value head per query head, and transformers' model fails in "
                f"its first forward otherwise: set num_key_value_heads to {m.num_heads} (the weights do not change)"]
    return []


def validate(r: Recipe) -> list[str]:
    m, d, t, c = r.model, r.data, r.train, r.checkpoint
    p = []
    if m.arch not in ARCHS:
        p.append(f"model.arch: {m.arch!r} is not supported (choose one of {', '.join(ARCHS)})")
    if m.attn_implementation not in ATTN:
        p.append(f"model.attn_implementation: {m.attn_implementation!r} is not supported (choose one of "
                 f"{', '.join(ATTN)})")
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                 "moe_intermediate_size", "num_experts", "experts_per_token", "vocab_size"):
        if getattr(m, name) < 1:
            p.append(f"model.{name}: must be >= 1, got {getattr(m, name)}")
    if m.num_shared_experts < 1 and m.arch in ("deepseek_v3", "deepseek_v2", "qwen3_5_moe") and not m.init_from:
        p.append(f"model.num_shared_experts: {m.num_shared_experts}, but transformers' {m.arch} always builds its "
                 "shared-expert block (zero-width, it breaks ZeRO-3 and the export); set it to 1 or more, or use "
                 "qwen3_moe or mixtral for a model without shared experts")
    if m.experts_per_token > m.num_experts:
        p.append(f"model.experts_per_token ({m.experts_per_token}) must be <= model.num_experts ({m.num_experts})")
    if m.hidden_size % max(m.num_heads, 1) and not m.init_from:
        p.append(f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_heads ({m.num_heads})")
    if m.num_heads % max(m.num_kv_heads, 1):
        p.append(f"model.num_heads ({m.num_heads}) must be divisible by model.num_kv_heads ({m.num_kv_heads})")
    if not 0 <= m.first_dense_layers < m.num_layers:
        p.append(f"model.first_dense_layers ({m.first_dense_layers}) must be in [0, num_layers)")
    elif m.first_dense_layers and not m.arch.startswith("deepseek") and not m.init_from:
        p.append(f"model.first_dense_layers: {m.arch} is built with an MoE block in every layer (only deepseek_v3 and "
                 "deepseek_v2 take dense first layers); set it to 0")
    if d.seq_len < 2 or d.seq_len > m.max_position_embeddings:
        p.append(f"data.seq_len ({d.seq_len}) must be in [2, model.max_position_embeddings={m.max_position_embeddings}]")
    if t.max_steps < 1:
        p.append(f"train.max_steps: must be >= 1, got {t.max_steps}")
    if t.lr <= 0:
        p.append(f"train.lr: must be > 0, got {t.lr}")
    if t.warmup_steps < 0:
        p.append(f"train.warmup_steps: must be >= 0, got {t.warmup_steps}")
    if t.decay_steps is not None and t.decay_steps < 1:
        p.append(f"train.decay_steps: must be >= 1 (or null: train.max_steps), got {t.decay_steps}")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        p.append(f"train.min_lr_ratio ({t.min_lr_ratio}) must be in [0, 1]")
    if t.tokens_per_step_per_gpu is not None and t.tokens_per_step_per_gpu < 1:
        p.append(f"train.tokens_per_step_per_gpu: must be >= 1 (or left out), got {t.tokens_per_step_per_gpu}")
    if t.log_every < 1:
        p.append(f"train.log_every: must be >= 1, got {t.log_every}")
    if t.fp8 not in (False, "dense", "all"):
        p.append(f"train.fp8: {t.fp8!r} is not one of false, dense, all")
    if t.stochastic_rounding not in (True, False, "auto"):
        p.append(f"train.stochastic_rounding: {t.stochastic_rounding!r} is not one of true, false, auto")
    if t.compile not in (True, False, "auto"):
        p.append(f"train.compile: {t.compile!r} is not one of true, false, auto")
    if t.activation_checkpointing not in (True, False, "auto"):
        p.append(f"train.activation_checkpointing: {t.activation_checkpointing!r} is not one of true, false, auto")
    if t.balance_rate < 0:
        p.append(f"train.balance_rate: must be >= 0, got {t.balance_rate}")
    if t.balance_rate > 0 and m.arch != "deepseek_v3":
        p.append(f"train.balance_rate: aux-loss-free balancing needs a routing-bias buffer that {m.arch} does "
                 "not have (only deepseek_v3); set it to 0")
    g = r.grpo
    if g.group_size < 2:
        p.append(f"grpo.group_size ({g.group_size}) must be >= 2: advantages compare completions within a group")
    for name in ("max_new_tokens", "iterations", "eval_every"):
        if getattr(g, name) < 1:
            p.append(f"grpo.{name} ({getattr(g, name)}) must be >= 1")
    no_chains = "grpo.tree" if g.tree.enabled else "grpo.rollout: engine" if g.rollout == "engine" else None
    if not 0 <= g.min_new_tokens <= g.max_new_tokens:
        p.append(f"grpo.min_new_tokens ({g.min_new_tokens}) must be in [0, grpo.max_new_tokens ({g.max_new_tokens})]")
    elif g.min_new_tokens and no_chains:
        p.append(f"grpo.min_new_tokens works with the local decoder's chain rollouts only; set it to 0 with {no_chains}")
    if g.rollout_correction != "none" and no_chains:
        p.append(f"grpo.rollout_correction {g.rollout_correction} needs the rollout decoder's log-probs, which "
                 f"only the local decoder's chain rollouts record; set it to none with {no_chains}")
    if g.routing_replay not in ("off", "r3"):
        p.append(f"grpo.routing_replay: {g.routing_replay!r} is not one of off, r3")
    elif g.routing_replay == "r3" and g.rollout == "engine":
        p.append("grpo.routing_replay r3 replays the expert choices the rollout decoder records, and "
                 "grpo.rollout: engine has no decoder; set grpo.rollout: local (or auto), or routing_replay: off")
    if g.temperature <= 0:
        p.append(f"grpo.temperature ({g.temperature}) must be > 0: rollouts sample from softmax(logits / temperature) "
                 + ("(a negative one favours the least likely tokens)" if g.temperature < 0 else
                    "(at 0 every completion of a group is the same, so every advantage is 0 and nothing is learned; "
                    "held-out evaluation is greedy already)") + "; 1.0 samples the model as it is")
    if not 0 < g.top_p <= 1:
        p.append(f"grpo.top_p ({g.top_p}) must be in (0, 1]: the probability mass of the nucleus sampled from "
                 "(1.0: the whole distribution)")
    if g.prompts_per_step_per_gpu is not None and g.prompts_per_step_per_gpu < 1:
        p.append(f"grpo.prompts_per_step_per_gpu ({g.prompts_per_step_per_gpu}) must be >= 1 (or null: 64 sequences "
                 "per GPU with an \"auto\" batch, micro x accumulation with numbers in the DS config)")
    if g.max_generated_tokens is not None and g.max_generated_tokens < 1:
        p.append(f"grpo.max_generated_tokens ({g.max_generated_tokens}) must be >= 1 (or null: stop at "
                 "train.max_steps only)")
    p += tree_problems(g)
    if g.decode_attention not in ("auto", "torch", "triton"):
        p.append(f"grpo.decode_attention: {g.decode_attention!r} is not one of auto, torch, triton")
    if g.decode_experts not in ("auto", "grouped_mm", "dense", "batched_mm", "eager"):
        p.append(f"grpo.decode_experts: {g.decode_experts!r} is not one of auto, grouped_mm, dense, batched_mm, eager")
    if g.rollout not in ("auto", "local", "engine"):
        p.append(f"grpo.rollout: {g.rollout!r} is not one of auto, local, engine")
    if g.eval_path is not None and not Path(g.eval_path).exists():
        p.append(f"grpo.eval_path {g.eval_path}: no such file")
    p += curriculum_problems(g.curriculum, d)
    if c.every_steps < 0 or c.every_minutes < 0 or c.keep_last < 1:
        p.append("checkpoint: every_steps and every_minutes must be >= 0 and keep_last >= 1")
    return p


DATA_CURRICULA = ("none", "length", "score")


def curriculum_problems(c: CurriculumConfig, d: DataConfig) -> list[str]:
    """grpo.curriculum and data.curriculum."""
    p = []
    band = c.band
    if len(band) != 2 or not all(_type_ok(x, float) for x in band):
        p.append(f"grpo.curriculum.band: expected [low, high], two pass rates, got {band!r}")
    elif not all(0.0 <= x <= 1.0 for x in band):
        p.append(f"grpo.curriculum.band {band}: both ends must be in [0, 1] (pass rates), e.g. [0.2, 0.8]")
    elif band[0] > band[1]:
        p.append(f"grpo.curriculum.band {band}: low must be <= high (inverted); write [{band[1]}, {band[0]}]")
    if not 0.0 <= c.unseen_share <= 1.0:
        p.append(f"grpo.curriculum.unseen_share ({c.unseen_share}) must be in [0, 1]: the share of each step's "
                 "prompts drawn from prompts not tried yet")
    if not 0.0 < c.outside_weight <= 1.0:
        p.append(f"grpo.curriculum.outside_weight ({c.outside_weight}) must be in (0, 1]: prompts outside the band "
                 "are drawn less often than those inside it, but never starved")
    if not 0.0 <= c.decay <= 1.0:
        p.append(f"grpo.curriculum.decay ({c.decay}) must be in [0, 1]")
    dc = d.curriculum
    if dc.mode not in DATA_CURRICULA:
        p.append(f"data.curriculum.mode: {dc.mode!r} is not one of {', '.join(DATA_CURRICULA)}")
    elif dc.mode == "score" and not dc.score_column:
        p.append("data.curriculum.mode score needs data.curriculum.score_column: a numeric column of data.path")
    elif dc.mode != "none" and d.streaming:
        p.append(f"data.curriculum.mode {dc.mode} needs map-style data (ordering sees every document first); set "
                 "data.streaming: false, or data.curriculum.mode: none")
    if dc.mode != "score" and dc.score_column is not None and dc.mode in DATA_CURRICULA:
        p.append(f"data.curriculum.score_column is set but data.curriculum.mode is {dc.mode}; set mode: score")
    return p
