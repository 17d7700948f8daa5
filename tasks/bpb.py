"""eval.py bpb: bits per byte of a pretraining-format file, so models with different tokenizers compare."""
import dataclasses

from data import Loader, PretrainData
from errors import DataError
from losses import count_token_bytes, lm_totals
from tasks.common import EvalConfig, load
from token_cache import tokenize_file


@dataclasses.dataclass
class BpbConfig(EvalConfig):
    # --- data
    data_path: str = "data/pretrain_val.jsonl"  # pretraining format: JSONL {"text"} or .txt; a glob / comma list
    max_windows: int | None = None  # windows of the model's max_seq_len + 1 tokens to score; None: all


def evaluate(cfg: BpbConfig) -> tuple[dict, dict]:
    """(the report's section, the checkpoint's state)."""
    model, tokenizer, state, run = load(cfg)
    T = model.config.max_seq_len
    data = PretrainData(tokenize_file(cfg.data_path, tokenizer, "pretrain"), T)
    if len(data) == 0:
        raise DataError(f"{cfg.data_path}: fewer than the {T + 1} tokens of one window")
    windows = [data[i] for i in range(min(len(data), cfg.max_windows or len(data)))]  # memory-mapped views
    loader = Loader(windows, cfg.batch_size, tokenizer.pad_id, run.device)
    totals = lm_totals(model, loader.batches(len(windows)), count_token_bytes(tokenizer), run)
    result = {"data_path": cfg.data_path, "windows": len(windows), "window_tokens": T} | totals
    print(f"{cfg.data_path}: bpb {totals['bpb']:.4f} | loss {totals['loss']:.4f} | ppl {totals['ppl']:.2f} "
          f"({result['windows']:,} windows of {T} tokens: {totals['tokens']:,} tokens, {totals['bytes']:,} bytes)")
    return result, state


def render(s: dict) -> list[str]:
    return ["## Bits per byte", "", f"**{s['bpb']:.4f} bits per byte** (loss {s['loss']:.4f}, ppl {s['ppl']:.2f}) on "
            f"`{s['data_path']}`: {s['windows']:,} windows of {s['window_tokens']} tokens, {s['tokens']:,} tokens, "
            f"{s['bytes']:,} bytes."]
