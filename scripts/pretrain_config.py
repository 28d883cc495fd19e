"""The pretraining run description: a YAML/JSON file of stages (+ model, data, training knobs), validated.

    model:            # RoFormerRopeConfig fields, checked (or only `init_from: FOLDER` to continue a checkpoint)
      hidden_size: 256
      num_hidden_layers: 4
      num_attention_heads: 4
      intermediate_size: 1024
    data:
      held_out_lines: 1000      # the last lines of the corpus, never trained on
      vocab_words: 20000        # jieba words in a vocabulary built when none is given
      eval_sequences: 128       # held-out sequences evaluated after every stage
    train:
      seed: 0
      micro_batch: 16           # sequences per forward pass and rank (default: the whole share)
      weight_decay: 0.01
      checkpoint_every: 200     # optimizer steps
    stages:                     # the paper's Table 4 curriculum, in miniature
      - {max_length: 128, global_batch: 64, steps: 400, lr: 1.0e-3, warmup_steps: 40}
      - {max_length: 512, global_batch: 16, steps: 100, lr: 5.0e-4, warmup_steps: 10, reset_optimizer: false}

Per stage: `schedule` is "linear" (warmup then linear decay to `min_lr_ratio`·lr, default) or "cosine" or
"constant"; the learning rate re-warms at every stage start (as DeepSpeedExamples' bing_bert does at its
sequence-length switch). Weights always carry over; Adam's moments carry over too unless the stage says
`reset_optimizer: true` — carrying them is the default because a stage switch changes the data's length, not
the loss landscape, and fresh moments after warmup cost a few hundred noisy steps (the paper's stages follow
each other the same way: one optimizer throughout).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEDULES = ("linear", "cosine", "constant")
ARCHITECTURES = ("roformer", "bert")


@dataclass
class Stage:
    max_length: int
    global_batch: int
    steps: int
    lr: float
    warmup_steps: int = 0
    schedule: str = "linear"
    min_lr_ratio: float = 0.0
    reset_optimizer: bool = False
    micro_batch: int | None = None
    name: str | None = None

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based) of this stage."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.min_lr_ratio * self.lr
        if self.schedule == "cosine":
            return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (self.lr - floor) * (1.0 - progress)


@dataclass
class DataOptions:
    held_out_lines: int = 1000
    vocab_words: int = 20000
    vocab_min_char_count: int = 2
    eval_sequences: int = 128
    mlm_probability: float = 0.15
    num_proc: int = 2
    text_column: str = "text"


@dataclass
class TrainOptions:
    seed: int = 0
    micro_batch: int | None = None
    weight_decay: float = 0.01
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    log_every: int = 10
    eval_batch: int = 16


@dataclass
class RunConfig:
    stages: list[Stage]
    model: dict[str, Any] = field(default_factory=dict)
    data: DataOptions = field(default_factory=DataOptions)
    train: TrainOptions = field(default_factory=TrainOptions)
    architecture: str = "roformer"
    source: str = "<dict>"

    @property
    def max_length(self) -> int:
        return max(stage.max_length for stage in self.stages)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("source")
        return out


def _yaml_load(text: str) -> Any:
    """`yaml.safe_load`, except that `1e-3` / `1.5e3` are the numbers they are in YAML 1.2 and JSON, not strings.

    PyYAML follows YAML 1.1, whose floats need a dot and a signed exponent (`1.0e-3`, `1.5e+3`): `lr: 1e-3`
    would be the string "1e-3"."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # YAML 1.1's own floats need a dot and a signed exponent: also read 1e-3, 1.5e3, 2.0E5, .5e-2
    exponent_float = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent_float, list("-+.0123456789"))
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass


def _read(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"--config {path}: cannot read it ({error.strerror or error})") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            data = _yaml_load(text)
    except Exception as error:  # noqa: BLE001 - yaml and json raise different types
        reason = " ".join(str(error).split())  # one line: yaml's messages span several
        raise ValueError(f"--config {path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'} ({reason})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping with a 'stages' list, got {type(data).__name__}")
    return data


def _build(cls, values: Any, where: str):
    if values is None:
        return cls()
    if not isinstance(values, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(values).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(names)}")
    try:
        return cls(**values)
    except TypeError as error:
        raise ValueError(f"{where}: {error}") from None


def _check_number(where: str, name: str, value, kind=int, minimum=None, maximum=None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ValueError(f"{where}: {name} must be {'a number' if kind is float else 'an integer'}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{where}: {name} must be <= {maximum}, got {value}")


def validate_stage(stage: Stage, where: str) -> None:
    _check_number(where, "max_length", stage.max_length, minimum=8)
    _check_number(where, "global_batch", stage.global_batch, minimum=1)
    _check_number(where, "steps", stage.steps, minimum=1)
    _check_number(where, "lr", stage.lr, float, minimum=0.0)
    _check_number(where, "warmup_steps", stage.warmup_steps, minimum=0, maximum=stage.steps)
    _check_number(where, "min_lr_ratio", stage.min_lr_ratio, float, minimum=0.0, maximum=1.0)
    if stage.micro_batch is not None:
        _check_number(where, "micro_batch", stage.micro_batch, minimum=1)
    if stage.schedule not in SCHEDULES:
        raise ValueError(f"{where}: schedule must be one of {SCHEDULES}, got {stage.schedule!r}")


# Keys of the `model:` section the code itself reads (the rest are fields of the architecture's config class),
# and the pre-v5 rotary fields RoFormerRopeConfig still accepts (moved into `rope_parameters`).
# consumed by the run (init_from) or accepted by every transformers config's constructor (the attention backend)
MODEL_KEYS = ("init_from", "attn_implementation")
LEGACY_ROFORMER_KEYS = ("rope_theta", "rope_scaling")


def config_class(architecture: str):
    """The transformers config class of an architecture ("roformer": RoFormerRopeConfig, "bert": BertConfig)."""
    if architecture == "bert":
        from transformers import BertConfig

        return BertConfig
    from modeling_roformer_rope import RoFormerRopeConfig

    return RoFormerRopeConfig


def model_fields(architecture: str) -> set[str]:
    """The keys a `model:` section may hold. transformers v5 configs are `@strict` dataclasses whose generated
    `__init__` passes unknown keyword arguments on as plain attributes (`accept_kwargs=True`), so a typo such
    as `hidden_sizes` would silently leave the default; `dataclasses.fields` lists the real ones."""
    cls = config_class(architecture)
    names = {f.name for f in dataclasses.fields(cls)} | set(getattr(cls, "attribute_map", {})) | set(MODEL_KEYS)
    if architecture == "roformer":
        names |= set(LEGACY_ROFORMER_KEYS)
    return names


def _check_model_section(model: dict, architecture: str, source: str) -> None:
    known = model_fields(architecture)
    unknown = sorted(set(model) - known)
    if unknown:
        name = config_class(architecture).__name__
        raise ValueError(f"{source}: model: unknown field(s) {unknown} (not {name} fields; see its docstring)")
    if model.get("tie_word_embeddings", True) is not True:
        raise ValueError(
            f"{source}: model.tie_word_embeddings must stay true: the MLM decoder is the word embedding (as in the "
            "original RoFormer), and the export reads it so"
        )
    init_from = model.get("init_from")
    if init_from is not None:
        if not isinstance(init_from, str) or not init_from:
            raise ValueError(f"{source}: model.init_from must be a folder (or Hub id), got {init_from!r}")
        others = sorted(set(model) - {"init_from"})
        if others:
            raise ValueError(
                f"{source}: model: {others} cannot be combined with init_from (the model, its config and its "
                f"tokenizer come from {init_from})"
            )
        if architecture != "roformer":
            raise ValueError(f"{source}: model.init_from continues a RoFormer, not architecture {architecture}")


def _one_line(error: BaseException) -> str:
    """The reason of a (possibly multi-line) validation error, on one line."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    reason = lines[-1] if lines else type(error).__name__
    for prefix in ("ValueError: ", "TypeError: "):
        reason = reason.removeprefix(prefix)
    return reason


def model_config(config: RunConfig, attention_type: str | None = None):
    """The model's transformers config, built from the `model:` section without allocating weights, so a bad
    section (heads that do not divide the width, a wrong type, an unknown `init_from`) and a stage longer than
    `max_position_embeddings` are refused before anything is written. `vocab_size` is the class default here
    (the run sets it from the tokenizer)."""
    section = dict(config.model)
    init_from = section.pop("init_from", None)
    if init_from:
        if attention_type:
            raise ValueError(f"--attention-type cannot be combined with model.init_from ({init_from} sets it)")
        from transformers import AutoConfig

        try:
            built = AutoConfig.from_pretrained(init_from, trust_remote_code=True)
        except (OSError, ValueError) as error:
            reason = f"model.init_from {init_from}: cannot load its config ({_one_line(error)})"
            raise ValueError(f"{config.source}: {reason}") from None
    else:
        if attention_type:
            section["attention_type"] = attention_type
        section = {"max_position_embeddings": config.max_length, **section}
        try:
            built = config_class(config.architecture)(**section)
        except Exception as error:  # noqa: BLE001 - strict dataclass validation raises its own error types
            raise ValueError(f"{config.source}: model: {_one_line(error)}") from None
    limit = built.max_position_embeddings
    for stage in config.stages:
        if stage.max_length > limit:
            raise ValueError(
                f"{config.source}: {stage.name}: max_length {stage.max_length} is longer than the model allows "
                f"(max_position_embeddings = {limit}); raise model.max_position_embeddings"
            )
    return built


def parse_run_config(data: dict, source: str = "<dict>") -> RunConfig:
    unknown = sorted(set(data) - {"stages", "model", "data", "train", "architecture"})
    if unknown:
        raise ValueError(f"{source}: unknown section(s) {unknown}; expected stages, model, data, train, architecture")
    stages_raw = data.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        raise ValueError(f"{source}: 'stages' must be a non-empty list of stages")
    stages = [_build(Stage, raw, f"{source}: stage {i + 1}") for i, raw in enumerate(stages_raw)]
    for i, stage in enumerate(stages):
        validate_stage(stage, f"{source}: stage {i + 1}")
        stage.name = stage.name or f"stage {i + 1}"
    model = data.get("model") or {}
    if not isinstance(model, dict):
        raise ValueError(f"{source}: 'model' must be a mapping of config fields")
    architecture = data.get("architecture", "roformer")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"{source}: architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    _check_model_section(model, architecture, source)
    config = RunConfig(
        stages=stages,
        model=dict(model),
        data=_build(DataOptions, data.get("data"), f"{source}: data"),
        train=_build(TrainOptions, data.get("train"), f"{source}: train"),
        architecture=architecture,
        source=source,
    )
    data_, train = config.data, config.train
    for name in ("held_out_lines", "vocab_words", "vocab_min_char_count", "eval_sequences", "num_proc"):
        _check_number(source, f"data.{name}", getattr(data_, name), minimum=1)
    _check_number(source, "data.mlm_probability", data_.mlm_probability, float)
    if not 0.0 < data_.mlm_probability < 1.0:
        raise ValueError(f"{source}: data.mlm_probability must be in (0, 1), got {data_.mlm_probability}")
    if not isinstance(data_.text_column, str) or not data_.text_column:
        raise ValueError(f"{source}: data.text_column must be a column name, got {data_.text_column!r}")
    _check_number(source, "train.seed", train.seed, minimum=0)
    if train.micro_batch is not None:
        _check_number(source, "train.micro_batch", train.micro_batch, minimum=1)
    _check_number(source, "train.weight_decay", train.weight_decay, float, minimum=0.0)
    for name in ("checkpoint_every", "keep_checkpoints", "log_every", "eval_batch"):
        _check_number(source, f"train.{name}", getattr(train, name), minimum=1)
    return config


def load_run_config(path: str | Path) -> RunConfig:
    path = Path(path)
    return parse_run_config(_read(path), str(path))


def fill_deepspeed_config(
    ds_config: dict, *, micro_batch: int, global_batch: int, world_size: int, precision: str, lr: float,
    weight_decay: float, on_cpu: bool, hidden_size: int,
) -> dict:
    """Resolve the "auto" values of a shipped DeepSpeed config from the run (as the Trainer integration does).

    Batch sizes come from the first stage (later stages change them on the live engine); `precision` fills
    `bf16.enabled` / `fp16.enabled`; on CPU the optimizer is torch's fused AdamW (`torch_adam`, no C++ build).
    ZeRO bucket sizes scale with the model width, with the Trainer integration's rules: reduce/allgather
    buckets hidden², ZeRO-3 prefetch 0.9·hidden², ZeRO-3 persistence threshold 10·hidden (`hidden_size`).
    """
    config = json.loads(json.dumps(ds_config))  # deep copy
    gas, rest = divmod(global_batch, micro_batch * world_size)
    if rest:
        raise ValueError(
            f"global batch {global_batch} is not divisible by micro batch {micro_batch} × world size {world_size}"
        )
    auto = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
    }
    for key, value in auto.items():
        if config.get(key, "auto") == "auto":
            config[key] = value
        elif config[key] != value:
            raise ValueError(f"DeepSpeed config sets {key}={config[key]}, but the stages need {value}: use \"auto\"")
    for name, wanted in (("bf16", precision == "bf16"), ("fp16", precision == "fp16")):
        section = config.setdefault(name, {"enabled": "auto"})
        if section.get("enabled", "auto") == "auto":
            section["enabled"] = wanted
    if on_cpu and config["fp16"]["enabled"]:
        raise ValueError("fp16 needs a GPU (loss scaling on CPU is not supported): use --precision bf16 or fp32")
    optimizer = config.setdefault("optimizer", {"type": "AdamW", "params": {}})
    params = optimizer.setdefault("params", {})
    for key, value, source in (("lr", lr, "the stage's lr"), ("weight_decay", weight_decay, "train.weight_decay")):
        if params.get(key, "auto") == "auto":
            params[key] = value
        elif params[key] != value:  # the engine sets both on every step: the file's value would be ignored
            raise ValueError(
                f"DeepSpeed config sets optimizer.params.{key}={params[key]}, but {source} is {value}: use \"auto\" "
                "(the stages of --config set the learning rate, its train section the weight decay)"
            )
    for key, value in (("betas", [0.9, 0.999]), ("eps", 1e-8)):  # a Trainer-style file: the Trainer's defaults
        if params.get(key) == "auto":
            params[key] = value
    if str(optimizer.get("type", "")).lower() in ("adam", "adamw"):  # only DeepSpeed's Adam variants know torch_adam
        if params.get("torch_adam", "auto") == "auto":
            params["torch_adam"] = on_cpu
        if params["torch_adam"] is True and "foreach" not in params:
            # torch's fused AdamW: one pass over the (flat) partition, no full-size temporaries; 8× faster
            # than the foreach version on a 50M-parameter partition on CPU.
            params.setdefault("fused", True)
    elif params.get("torch_adam") == "auto":
        del params["torch_adam"]
    zero = config.get("zero_optimization", {})
    sizes = {
        "reduce_bucket_size": hidden_size * hidden_size,
        "allgather_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }
    for key, value in sizes.items():
        if zero.get(key) == "auto":
            zero[key] = value
    unresolved = _auto_keys(config)
    if unresolved:
        raise ValueError(f"DeepSpeed config: cannot resolve \"auto\" for {', '.join(unresolved)}")
    return config


def _auto_keys(value, where: str = "") -> list[str]:
    """The dotted keys, at any depth, still set to "auto"."""
    if isinstance(value, dict):
        return [k for key, v in value.items() for k in _auto_keys(v, f"{where}.{key}" if where else str(key))]
    return [where] if value == "auto" else []


def deepspeed_precision(ds_config: dict, precision: str | None, source: str) -> str:
    """The run's precision: `--precision`, else the one the DeepSpeed file enables (`bf16` / `fp16` with
    `"enabled": true`), else fp32. An explicit `enabled` that contradicts `--precision` is refused: DeepSpeed would
    train in the file's precision while the run's log, state and model card said `--precision`."""
    enabled = {}
    for name in ("bf16", "fp16"):
        section = ds_config.get(name)
        value = section.get("enabled", "auto") if isinstance(section, dict) else "auto"
        if value != "auto":
            if not isinstance(value, bool):
                raise ValueError(f"{source}: {name}.enabled must be true, false or \"auto\", got {value!r}")
            enabled[name] = value
    on = [name for name, value in enabled.items() if value]
    if len(on) > 1:
        raise ValueError(f"{source}: bf16 and fp16 are both enabled; enable one (or leave both \"auto\")")
    if precision is None:
        return on[0] if on else "fp32"
    for name, value in enabled.items():
        if value != (precision == name):
            raise ValueError(
                f"{source}: {name}.enabled is {str(value).lower()}, but --precision is {precision}: set it to "
                f"\"auto\" (or give the --precision it means)"
            )
    return precision


# DeepSpeed config sections read as JSON objects (here and by DeepSpeed).
DEEPSPEED_SECTIONS = ("zero_optimization", "optimizer", "scheduler", "bf16", "fp16")
# The pydantic models DeepSpeed validates its sections with, and the section each one checks.
_DEEPSPEED_MODELS = {
    "DeepSpeedZeroConfig": "zero_optimization",
    "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
    "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
}


def _known_optimizer(name: str) -> bool:
    """A name `deepspeed.initialize` can build: one of DeepSpeed's own, or a class of `torch.optim`."""
    try:
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    except ImportError:  # checked again by DeepSpeed itself when the engine starts
        return True
    import torch

    return name.lower() in DEEPSPEED_OPTIMIZERS or isinstance(getattr(torch.optim, name, None), type)


def check_deepspeed_sections(config: dict, source: str) -> None:
    """What DeepSpeed's own config parser lets through and `deepspeed.initialize` would refuse (or silently
    override) only after the data is prepared."""
    for key in DEEPSPEED_SECTIONS:
        if key in config and not isinstance(config[key], dict):
            raise ValueError(f"{source}: {key} must be a JSON object, got {config[key]!r}")
    if "scheduler" in config:
        raise ValueError(
            f"{source}: scheduler: the stages set the learning rate (warm-up and decay in each stage of --config); "
            "remove this section"
        )
    optimizer = config.get("optimizer", {})
    params = optimizer.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"{source}: optimizer.params must be a JSON object, got {params!r}")
    kind = optimizer.get("type", "AdamW")
    if not isinstance(kind, str) or not _known_optimizer(kind):
        raise ValueError(
            f"{source}: optimizer.type {kind!r} is neither a DeepSpeed optimizer (Adam, AdamW, Lamb, Lion, ...) "
            "nor a torch.optim class"
        )
    clipping = config.get("gradient_clipping", 0.0)
    if isinstance(clipping, bool) or not isinstance(clipping, (int, float)) or clipping < 0:
        raise ValueError(f"{source}: gradient_clipping must be a number >= 0, got {clipping!r}")


def check_deepspeed_config(config: dict, source: str) -> None:
    """Let DeepSpeed parse the resolved config (a ZeRO stage that does not exist, an unknown ZeRO key, a
    batch that does not add up) now, not at `deepspeed.initialize` after the data is prepared. Needs the
    process group (DeepSpeed reads the world size)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig(json.loads(json.dumps(config)))
    except Exception as error:  # noqa: BLE001 - pydantic, assertion and DeepSpeed's own errors
        errors = getattr(error, "errors", None)
        if callable(errors) and hasattr(error, "title"):  # pydantic: name the section and the field
            where = _DEEPSPEED_MODELS.get(error.title, error.title)
            reason = "; ".join(
                f"{'.'.join([where, *map(str, e['loc'])])}: {e['msg']} (got {e.get('input')!r})" for e in errors()
            )
        else:
            reason = _one_line(error)
        raise ValueError(f"{source}: DeepSpeed refuses it: {reason}") from None


__all__ = [
    "RunConfig",
    "Stage",
    "check_deepspeed_config",
    "check_deepspeed_sections",
    "deepspeed_precision",
    "fill_deepspeed_config",
    "load_run_config",
    "model_config",
    "model_fields",
    "parse_run_config",
]
