"""
The one interface of eval.py's benchmarks, and what they share. Each module of tasks/ (bpb, sft, choice, pairs,
passk, toolcall) offers:

    a config dataclass   an EvalConfig subclass: the sub-command's keys (`python eval.py sft --help` lists them)
    evaluate(cfg)        -> (its figures, the checkpoint's state); prints them, the figures go to report.json
    render(figures)      -> its section of report.md, as lines of Markdown

eval.py maps each sub-command to its module; report.py writes report.json and report.md.
"""
import dataclasses

from checkpoint import load_model
from config import check_device_and_dtype
from errors import ConfigError
from runtime import setup


@dataclasses.dataclass
class EvalConfig:
    # --- I/O
    ckpt: str = "out/sft/best.pt"  # a checkpoint written by train_pretrain/sft/dpo.py
    out: str | None = None  # where report.md and report.json go; None: the checkpoint's directory
    plots: str | None = None  # a directory of plot.py's pictures for the report to link; None: the checkpoint's
    tokenizer_path: str | None = None  # None: the one the checkpoint was trained with (another one is refused)
    # --- system
    batch_size: int = 16  # sequences per forward pass
    device: str = "auto"  # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto (what the device runs well: float32 on a CPU) | float32 | bfloat16 | float16
    seed: int = 1337  # sampling with temperature > 0

    def __post_init__(self):
        check_device_and_dtype(self.device, self.dtype)
        if self.batch_size < 1:
            raise ConfigError(f"config key 'batch_size' must be at least 1, got {self.batch_size}")


def load(cfg: EvalConfig):
    """(eval-mode model, its tokenizer, the checkpoint's state, Run)."""
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    model, tokenizer, state = load_model(cfg.ckpt, run.device, cfg.tokenizer_path)
    return model, tokenizer, state, run


def cell(text: str) -> str:
    """Text in full inside a Markdown table cell."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")
