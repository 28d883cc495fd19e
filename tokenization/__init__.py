"""Vocabulary building and corpus helpers for roformer-rope (installed as `roformer_rope.tokenization`)."""
