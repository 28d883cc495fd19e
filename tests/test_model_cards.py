"""The pretrained model card says what the run was: its architecture's tags, and where its weights started."""

from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from modeling_roformer_rope import RoFormerRopeForMaskedLM
from roformer_rope.conversion.model_card import render_model_card
from roformer_rope.scripts.pretrain_export import card_values


def _card(architecture: str, init_from: str | None = None) -> str:
    info = {"architecture": architecture, "zero_stage": 2, "precision": "fp32", "corpus": "People's Daily"}
    if init_from:
        info["init_from"] = init_from
    state = {"info": info, "world_size": 1, "stage_table": []}
    torch.manual_seed(0)
    values = card_values(state, RoFormerRopeForMaskedLM(tiny_config()), "t", Path("checkpoint-1"), "me/t")
    return render_model_card(values, template="roformer_pretrained.md")


@pytest.mark.parametrize("architecture, tags", [("roformer", ["roformer", "rotary"]), ("bert", ["bert"])])
def test_tags_follow_the_architecture_once_each(architecture, tags):
    meta = _card(architecture).split("---")[1]
    listed = [line[2:] for line in meta.splitlines() if line.startswith("- ") and line[2:] not in ("zh",)]
    assert listed == [*tags, "fill-mask"]


def test_continued_pretraining_names_its_start():
    assert "pretrained from scratch" in _card("roformer")
    card = _card("roformer", init_from="runs/stage-1/model")
    assert "pretrained from `runs/stage-1/model`" in card and "from scratch" not in card
