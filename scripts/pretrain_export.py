"""Export a pretraining checkpoint to a Hub-ready folder (`roformer-rope pretrain --export CKPT --out DIR`).

The ZeRO shards are consolidated to float32 with DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint`,
loaded strictly into a fresh model, and checked before anything is written:
- tied weights: `zero_to_fp32` has mis-handled tied parameters (DeepSpeed #1896, #3824), so the MLM decoder
  must *be* the word embedding after loading, and equal it in the file if the file holds both;
- the probe: every checkpoint stores the live model's logits on a fixed held-out batch; the consolidated model,
  in the dtype the engine ran in, must reproduce them (this catches a wrong, stale or mis-tied export).
The folder (config with `auto_map`, `model.safetensors`, tokenizer, payload code, model card with the stage
table) is written through `safe_output_folder`: all or nothing, an existing `--out` only replaced with
`--overwrite`, the checkpoint itself never touched.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

PROBE_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}


def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder, its `checkpoints/` folder (→ the one `latest` names) or one checkpoint folder."""
    path = Path(path)
    for root in (path / "checkpoints", path):
        pointer = root / "latest"
        if pointer.is_file():
            path = root / pointer.read_text().strip()
            break
    if not (path / "run_state.json").is_file() or not (path / "model_config.json").is_file():
        raise FileNotFoundError(
            f"--export {path}: not a pretraining checkpoint (expected run_state.json and model_config.json, "
            "or a run/checkpoints folder with a `latest` file)"
        )
    return path


def build_model(model_config: dict, architecture: str, zero3_config: dict | None = None) -> torch.nn.Module:
    """A fresh MLM model of the run's architecture ("roformer" or "bert").

    With `zero3_config` (a resolved ZeRO-3 DeepSpeed config) the model is built the way transformers builds
    one under DeepSpeed: inside `deepspeed.zero.Init`, so every parameter is partitioned as soon as its module
    exists and no rank ever holds the full model (then initialised layer by layer, gathered).

    Both ways draw the same weights from the same seed: construction draws nothing (torch's default
    initialisers are off, as under `zero.Init`), then `_init_weights` runs module by module in the order
    transformers' ZeRO-3 initialiser uses, so a ZeRO-1/2 run and a ZeRO-3 run start from one model.
    """
    if architecture == "bert":
        from transformers import BertConfig, BertForMaskedLM

        cls, config = BertForMaskedLM, BertConfig(**model_config)
    else:
        from modeling_roformer_rope import RoFormerRopeConfig, RoFormerRopeForMaskedLM

        cls, config = RoFormerRopeForMaskedLM, RoFormerRopeConfig(**model_config)
    if zero3_config is None:
        from transformers.initialization import guard_torch_init_functions, no_init_weights

        with no_init_weights():
            model = cls(config)
        with torch.no_grad(), guard_torch_init_functions():
            model.initialize_weights()
        model.tie_weights()
        return model
    from transformers.integrations import HfDeepSpeedConfig

    zero3 = HfDeepSpeedConfig(zero3_config)  # transformers uses zero.Init while this object is alive
    try:
        model = cls._from_config(config)
    finally:
        del zero3  # later models (the export, a reload) are built normally
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        # transformers initialises on rank 0 and hands the other ranks its gathered parameters, not its buffers:
        # a Performer's random projection (a buffer redrawn by `_init_weights`) would differ between ranks.
        for buffer in model.buffers():
            torch.distributed.broadcast(buffer, 0)
    return model


def consolidated_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
    return {k.removeprefix("module."): v.float() for k, v in state.items()}


def load_checked(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Strict load, tied weights checked: a key may be missing from the file only if it shares storage with
    a key that is there (the tied MLM decoder), and keys sharing storage that are both in the file must be
    equal (a broken ZeRO consolidation of tied weights would make them differ)."""
    own = model.state_dict()
    groups: dict[int, list[str]] = {}
    for key, tensor in own.items():
        groups.setdefault(tensor.data_ptr(), []).append(key)
    for keys in groups.values():
        present = [k for k in keys if k in state_dict]
        for other in present[1:]:
            if not torch.equal(state_dict[other], state_dict[present[0]]):
                diff = (state_dict[other] - state_dict[present[0]]).abs().max().item()
                raise ValueError(
                    f"{source}: {other} and {present[0]} are tied but differ in the consolidated weights "
                    f"(max |diff| {diff:.3g}): a broken ZeRO consolidation of tied parameters"
                )
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    untied = [k for k in missing if not any(t in state_dict for t in groups[own[k].data_ptr()] if t != k)]
    if untied or unexpected:
        raise ValueError(f"{source}: weights do not fit the model: missing {untied[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    output, input_ = model.get_output_embeddings(), model.get_input_embeddings()
    if output is not None and output.weight.data_ptr() != input_.weight.data_ptr():
        raise ValueError(f"{source}: the MLM decoder is not tied to the word embedding after loading")


@torch.no_grad()
def probe_difference(model: torch.nn.Module, probe: dict) -> float:
    """Max |logit difference| between `model` (in the probe's dtype) and the live model's stored logits."""
    dtype = getattr(torch, probe["dtype"])
    model = model.to(dtype).eval()
    logits = model(**probe["batch"]).logits.float()
    model.float()
    keep = probe["batch"]["attention_mask"].bool()
    return (logits[keep] - probe["logits"].float()[keep]).abs().max().item()


def stage_table_markdown(rows: list[dict]) -> str:
    lines = [
        "| stage | max length | global batch | steps | MLM loss | MLM accuracy | tokens | time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['stage']} | {row['max_length']} | {row['global_batch']} | {row['steps']} | "
            f"{row['mlm_loss']:.3f} | {row['mlm_accuracy']:.1%} | {row['tokens']:,} | {row['seconds']:.0f} s |"
        )
    return "\n".join(lines)


def card_values(run_state: dict, model: torch.nn.Module, title: str, checkpoint: Path, repo_id: str) -> dict:
    config = model.config
    info = run_state["info"]
    attention = getattr(config, "attention_type", "softmax (learned absolute positions)")
    return {
        "license": "apache-2.0",
        "title": title,
        "architecture_name": "RoFormer" if info["architecture"] == "roformer" else "BERT (learned absolute positions)",
        # a BERT baseline is no RoFormer: its card is not tagged as one
        "architecture_tags": "- roformer\n- rotary" if info["architecture"] == "roformer" else "- bert",
        "origin": f"from `{info['init_from']}`" if info.get("init_from") else "from scratch",
        "zero_stage": str(info["zero_stage"]),
        "precision": info["precision"],
        "world_size": str(run_state["world_size"]),
        "corpus": info["corpus"],
        "num_stages": str(len(run_state["stage_table"])),
        "layers": str(config.num_hidden_layers),
        "hidden": str(config.hidden_size),
        "heads": str(config.num_attention_heads),
        "vocab_size": str(config.vocab_size),
        "parameters": f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M",
        "attention": attention,
        "stage_table": stage_table_markdown(run_state["stage_table"]) if run_state["stage_table"] else "(none finished)",
        "repo_id": repo_id,
        "checkpoint": checkpoint.name,
    }


RUN_MARKER = ".roformer_rope_run"  # the file `pretrain` writes into a run folder before anything else


def training_output(path: Path) -> str | None:
    """What pretraining output `path` holds (a checkpoint, a checkpoints folder, a run folder), or None: an export
    never replaces one, even with --overwrite (a resume would then find a Hub folder where its state was)."""
    if not path.is_dir():
        return None
    if (path / "run_state.json").is_file():
        return "a pretraining checkpoint"
    if (path / "latest").is_file() or any(path.glob("*/run_state.json")):
        return "a pretraining checkpoints folder"
    if (path / "checkpoints").is_dir() or (path / RUN_MARKER).is_file():
        return "a pretraining run folder"
    inner = next((p.parent for p in path.rglob("*") if p.name in (RUN_MARKER, "run_state.json")), None)  # one walk
    if inner is not None:
        return f"a folder holding pretraining output ({inner})"
    return None


def export_checkpoint(checkpoint: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Consolidate, check and write `checkpoint` as a Hub-ready folder at `out`; returns `out`."""
    from transformers import AutoTokenizer

    from roformer_rope.conversion.model_card import render_model_card
    from roformer_rope.safe_write import check_output, safe_output_folder

    checkpoint = resolve_checkpoint(checkpoint)
    out = Path(out)
    held = training_output(out)
    if held:
        raise ValueError(f"--out {out} is {held}: an export never replaces training output; choose another --out")
    check_output(out, overwrite=overwrite, sources=[checkpoint], what="--out")
    run_state = json.loads((checkpoint / "run_state.json").read_text())
    spec = json.loads((checkpoint / "model_config.json").read_text())
    model = build_model(spec["config"], spec["architecture"])
    load_checked(model, consolidated_state_dict(checkpoint), str(checkpoint))
    probe = torch.load(checkpoint / "probe.pt", weights_only=True)
    diff = probe_difference(model, probe)
    tolerance = PROBE_TOLERANCE[probe["dtype"]]
    if not diff <= tolerance:
        raise ValueError(
            f"{checkpoint}: the consolidated model's logits differ from the live model's by {diff:.3g} "
            f"(> {tolerance}) on the stored held-out probe: the export would not be the trained model"
        )
    logger.info("export check: logits within %.2g of the live model's (%s)", diff, probe["dtype"])
    if hasattr(model.config, "sparse_prediction"):
        model.config.sparse_prediction = False  # users get (B, T, V) logits, as from any MLM
    tokenizer = AutoTokenizer.from_pretrained(checkpoint / "tokenizer", trust_remote_code=True)
    with safe_output_folder(out, overwrite=overwrite, sources=[checkpoint], what="--out") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        table = run_state["stage_table"]
        (tmp / "pretraining_stages.json").write_text(json.dumps(table, indent=2, ensure_ascii=False))
        title = f"{out.resolve().name}"
        card = render_model_card(card_values(run_state, model, title, checkpoint, out.name), "roformer_pretrained.md")
        (tmp / "README.md").write_text(card, encoding="utf-8")
    logger.info("exported %s to %s", checkpoint, out)
    return out


__all__ = ["export_checkpoint", "resolve_checkpoint", "stage_table_markdown"]
