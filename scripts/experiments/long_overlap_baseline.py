"""How much does a longer window help on `long` without any learning? A word-overlap matcher.

    python scripts/experiments/long_overlap_baseline.py --tokenizer ft-long-512 [--lengths 128 256 512 1024 0]

For every pair of the `long` task (task_long.py) the two halves are tokenized with `--tokenizer` (any
folder holding our tokenizer, e.g. a fine-tuned or pretrained model), truncated exactly as the model input
would be at max length L (`[CLS] a [SEP] b [SEP]`, longest-first: tokens are taken from the longer half
until the pair fits), and scored by the Jaccard overlap of the multi-character word tokens of the two
halves (shared names, places, numbers, topic words). A threshold is fitted on train (the best train
accuracy) and applied to test. L = 0 means no truncation. Prints test accuracy on all pairs and on the
pairs longer than 512 tokens, and writes `--out` JSON if given.

An upper bound it is not; a check that the label is recoverable from the text and that more of the text
carries more of the evidence, independent of any trained model.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def truncate_pair(a: list[str], b: list[str], max_length: int) -> tuple[list[str], list[str]]:
    """`longest_first` truncation of a pair to `max_length` tokens including [CLS] and two [SEP]."""
    if max_length <= 0:
        return a, b
    budget = max_length - 3
    a, b = list(a), list(b)
    while len(a) + len(b) > budget:
        if len(a) > len(b):
            a.pop()
        else:
            b.pop()
    return a, b


def words(tokens: list[str]) -> set[str]:
    return {t for t in tokens if len(t) > 1 and not t.startswith("##") and not t.startswith("[")}


def jaccard(a: list[str], b: list[str]) -> float:
    x, y = words(a), words(b)
    return len(x & y) / len(x | y) if x or y else 0.0


def best_threshold(scores: np.ndarray, labels: np.ndarray) -> float:
    candidates = np.unique(scores)
    accuracy = [((scores >= t) == labels).mean() for t in candidates]
    return float(candidates[int(np.argmax(accuracy))])


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from roformer_rope.scripts import task_long

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a folder with our tokenizer")
    parser.add_argument("--lengths", nargs="+", type=int, default=[128, 256, 512, 1024, 0])
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=True)
    splits = task_long.load()
    tokens = {}
    for name in ("train", "test"):
        split = splits[name]
        tokens[name] = [(tokenizer.tokenize(h), tokenizer.tokenize(t)) for h, t in zip(split["head"], split["tail"])]
    labels = {name: np.array(splits[name]["label"]) for name in ("train", "test")}
    full = np.array([len(a) + len(b) + 3 for a, b in tokens["test"]])
    long = full > task_long.LONG_THRESHOLD
    results = {"n_test": int(len(full)), "n_test_long": int(long.sum()), "by_length": {}}
    print(f"test pairs: {len(full)}, longer than {task_long.LONG_THRESHOLD} tokens: {int(long.sum())}")
    for length in args.lengths:
        scores = {name: np.array([jaccard(*truncate_pair(a, b, length)) for a, b in tokens[name]]) for name in tokens}
        threshold = best_threshold(scores["train"], labels["train"])
        correct = (scores["test"] >= threshold) == labels["test"]
        row = {"threshold": threshold, "accuracy": float(correct.mean()), "accuracy_long": float(correct[long].mean())}
        results["by_length"][str(length or "full")] = row
        print(f"max length {length or 'full':>5}: test accuracy {row['accuracy']:.4f}, on pairs > 512 tokens {row['accuracy_long']:.4f}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
