"""MLM with the transformers `Trainer` on a list of lines (the short form; `pretrain` is the full job).

Used by the Trainer tests and handy for experiments: tokenize lines, train with BERT's 15% / 80-10-10 token
masking (`DataCollatorForLanguageModeling`), and measure held-out MLM loss and masked-token accuracy on one
fixed masking, the same positions before and after training.
"""

from __future__ import annotations

from pathlib import Path

from .mlm_data import masked_token_metrics


def tokenize_lines(tokenizer, lines: list[str], max_length: int) -> list[dict]:
    encoded = tokenizer(lines, truncation=True, max_length=max_length, return_token_type_ids=True)
    return [{k: encoded[k][i] for k in ("input_ids", "token_type_ids", "attention_mask")} for i in range(len(lines))]


def mlm_metrics(model, tokenizer, examples: list[dict], seed: int = 0) -> dict[str, float]:
    """Held-out MLM loss and accuracy of `model` on `examples` under one fixed (seeded) masking."""
    import torch
    from transformers import DataCollatorForLanguageModeling

    batch = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, seed=seed)(examples)
    model.eval()
    with torch.no_grad():
        metrics = masked_token_metrics(lambda b: model(**b).logits, [batch])
    return {"loss": metrics["loss"], "accuracy": metrics["accuracy"]}


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


__all__ = ["mlm_metrics", "tokenize_lines", "train_mlm"]
