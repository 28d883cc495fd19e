"""The pretraining run description: a YAML/JSON file of stages (+ model, data, training knobs), validated.

    model:            # RoFormerRopeConfig fields (or `init_from: FOLDER` to continue from a checkpoint)
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


def _read(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"--config {path}: cannot read it ({error.strerror or error})") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
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
    config = RunConfig(
        stages=stages,
        model=dict(model),
        data=_build(DataOptions, data.get("data"), f"{source}: data"),
        train=_build(TrainOptions, data.get("train"), f"{source}: train"),
        architecture=architecture,
        source=source,
    )
    _check_number(source, "data.held_out_lines", config.data.held_out_lines, minimum=1)
    _check_number(source, "data.eval_sequences", config.data.eval_sequences, minimum=1)
    _check_number(source, "train.checkpoint_every", config.train.checkpoint_every, minimum=1)
    _check_number(source, "train.keep_checkpoints", config.train.keep_checkpoints, minimum=1)
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
    for key, value in (("lr", lr), ("weight_decay", weight_decay)):
        if params.get(key, "auto") == "auto":
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
    for key, value in [*config.items(), *(("zero_optimization." + k, v) for k, v in zero.items())]:
        if value == "auto":
            raise ValueError(f"DeepSpeed config: cannot resolve \"auto\" for {key}")
    return config


__all__ = ["RunConfig", "Stage", "fill_deepspeed_config", "load_run_config", "parse_run_config"]
