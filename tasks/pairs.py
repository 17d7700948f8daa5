"""eval.py pairs: how often a reward model (train_reward.py) scores a pair's chosen answer above its rejected one."""
import dataclasses

import numpy as np
import torch

from checkpoint import checkpoint_tokenizer
from errors import DataError
from reward_model import bradley_terry_loss, reward_model_from_checkpoint, score_ids
from runtime import setup
from tasks.common import EvalConfig
from token_cache import tokenize_file


@dataclasses.dataclass
class PairsConfig(EvalConfig):
    # --- I/O
    ckpt: str = "out/reward/best.pt"  # a reward model, written by train_reward.py
    # --- data
    data_path: str = "data/dpo_eval.jsonl"  # preference pairs as train_dpo.py reads them, held out from training
    max_records: int | None = None  # the first this many pairs; None: all


def evaluate(cfg: PairsConfig) -> tuple[dict, dict]:
    """(the report's section, the checkpoint's state)."""
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    model, state = reward_model_from_checkpoint(cfg.ckpt, run.device)
    tokenizer = checkpoint_tokenizer(state, cfg.tokenizer_path)
    lengths = {k: state["config"][k] for k in ("max_prompt_length", "max_completion_length")}
    records = tokenize_file(cfg.data_path, tokenizer, "dpo", **lengths)  # rendered and cut as in training
    pairs = [records[i] for i in range(min(len(records), cfg.max_records or len(records)))]
    if not pairs:
        raise DataError(f"{cfg.data_path}: no pairs")
    chosen = [np.concatenate([prompt, answer]).tolist() for prompt, answer, _ in pairs]
    rejected = [np.concatenate([prompt, answer]).tolist() for prompt, _, answer in pairs]
    with run.autocast():
        rewards = torch.tensor(score_ids(model.eval(), chosen + rejected, tokenizer.pad_id, cfg.batch_size))
    loss, metrics = bradley_terry_loss(*rewards.view(2, -1))
    result = {"data_path": cfg.data_path, "pairs": len(pairs), "loss": loss.item()} | \
        {k: v.item() for k, v in metrics.items()}
    print(f"{cfg.data_path}, {len(pairs)} pairs: the chosen answer scores higher in {result['pair_acc']:.1%} | mean "
          f"margin {result['reward_margin']:.3f} | Bradley-Terry loss {result['loss']:.4f}")
    return result, state


def render(s: dict) -> list[str]:
    return ["## Preference pairs", "", f"The reward model scores the chosen answer above the rejected one in "
            f"**{s['pair_acc']:.1%}** of the {s['pairs']} pairs of `{s['data_path']}`.", "",
            "| metric | value |", "|---|---:|", f"| pair accuracy | {s['pair_acc']:.1%} |",
            f"| mean margin, r_chosen - r_rejected | {s['reward_margin']:.3f} |",
            f"| mean reward, chosen / rejected | {s['chosen_reward']:.3f} / {s['rejected_reward']:.3f} |",
            f"| Bradley-Terry loss, -log sigmoid(margin) | {s['loss']:.4f} |"]
