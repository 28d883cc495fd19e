"""A short Trainer MLM run on real People's Daily text must lower the held-out loss; gradient accumulation under the
Trainer equals one large batch for every head."""

import pytest
import torch

import modeling_roformer_rope as rr
from conftest import tiny_config
from modeling_roformer_rope import RoFormerRopeConfig, RoFormerRopeForMaskedLM
from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer
from roformer_rope.scripts.mlm_trainer import mlm_metrics, tokenize_lines, train_mlm
from roformer_rope.tokenization.build_vocab import build_vocab_file as build_vocab
from roformer_rope.tokenization.corpus import people_daily_lines


def test_trainer_mlm_loss_decreases(tmp_path):
    torch.manual_seed(0)
    lines = people_daily_lines(limit=1200)
    held_out, train_lines = lines[::10], [line for i, line in enumerate(lines) if i % 10]
    build_vocab(train_lines, tmp_path / "vocab.txt", num_words=200)
    tokenizer = RoFormerRopeTokenizer(vocab_file=str(tmp_path / "vocab.txt"))
    config = RoFormerRopeConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    model = RoFormerRopeForMaskedLM(config)
    train = tokenize_lines(tokenizer, train_lines, max_length=32)
    evaluation = tokenize_lines(tokenizer, held_out, max_length=32)
    before = mlm_metrics(model, tokenizer, evaluation)
    history = train_mlm(model, tokenizer, train, tmp_path / "run", steps=40, batch_size=16, lr=2e-3)
    after = mlm_metrics(model, tokenizer, evaluation)
    logged = [h["loss"] for h in history if "loss" in h]
    assert len(logged) >= 3 and logged[-1] < logged[0]
    # An untrained model is near log(V) ≈ 8; 40 steps must take at least one nat off on unseen text.
    assert after["loss"] < before["loss"] - 1.0, (before, after)


def _one_sgd_step(model, examples, batch_size, accumulation, out_dir):
    """Parameters after one optimizer step of plain SGD (lr 1, no clipping) over `examples` under the Trainer."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        out_dir,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=examples).train()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _head_examples(cls, problem, generator):
    """4 labelled examples for the head `cls` (every head's label form)."""
    ids = torch.randint(5, 99, (4, 3, 10) if cls is rr.RoFormerRopeForMultipleChoice else (4, 10), generator=generator)
    if problem == "regression":
        labels = {"labels": torch.randn(4, generator=generator)}
    elif problem == "multi_label_classification":
        labels = {"labels": (torch.rand(4, 3, generator=generator) < 0.5).float()}
    elif cls is rr.RoFormerRopeForSequenceClassification or cls is rr.RoFormerRopeForMultipleChoice:
        labels = {"labels": torch.tensor([0, 1, 2, 1])}
    elif cls is rr.RoFormerRopeForQuestionAnswering:
        labels = {"start_positions": torch.tensor([1, 2, 3, 4]), "end_positions": torch.tensor([5, 6, 7, 8])}
    else:  # token labels, with ignored positions that differ between examples
        token_labels = torch.randint(0, 3, ids.shape, generator=generator)
        token_labels[torch.rand(ids.shape, generator=generator) < 0.5] = -100
        labels = {"labels": token_labels}
    return [{"input_ids": ids[i], **{k: v[i] for k, v in labels.items()}} for i in range(4)]


@pytest.mark.parametrize(
    "cls, problem",
    [
        (rr.RoFormerRopeForSequenceClassification, None),
        (rr.RoFormerRopeForSequenceClassification, "regression"),
        (rr.RoFormerRopeForSequenceClassification, "multi_label_classification"),
        (rr.RoFormerRopeForMultipleChoice, None),
        (rr.RoFormerRopeForQuestionAnswering, None),
        (rr.RoFormerRopeForTokenClassification, None),
        (rr.RoFormerRopeForMaskedLM, None),
    ],
    ids=[
        "SequenceClassification",
        "regression",
        "multi-label",
        "MultipleChoice",
        "QuestionAnswering",
        "TokenClassification",
        "MaskedLM",
    ],
)
def test_gradient_accumulation_equals_one_large_batch(cls, problem, tmp_path):
    """2 micro-batches of 2 accumulated = 1 batch of 4: the Trainer must not get a loss it thinks is already
    normalised by `num_items_in_batch` when the head's loss is a plain mean (it skips its 1/steps scaling)."""
    examples = _head_examples(cls, problem, torch.Generator().manual_seed(0))
    config = tiny_config(num_labels=1 if problem == "regression" else 3, classifier_dropout=0.0, problem_type=problem)
    torch.manual_seed(0)
    initial = cls(config).state_dict()
    after = {}
    for batch_size, accumulation in ((4, 1), (2, 2)):
        model = cls(config)
        model.load_state_dict(initial)
        after[accumulation] = _one_sgd_step(model, examples, batch_size, accumulation, tmp_path / f"ga{accumulation}")
    moved = [name for name in after[1] if not torch.equal(after[1][name], initial[name])]
    assert moved, "the step changed nothing"
    for name in moved:
        torch.testing.assert_close(after[2][name], after[1][name], atol=1e-5, rtol=1e-4, msg=name)
