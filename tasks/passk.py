"""eval.py pass: how often a completion's final answer is the reference, on RL's prompts (reward=answer): pass@1 of
greedy answers, pass@1 and pass@k of k sampled ones."""
import dataclasses
import math

from data import read_prompts
from errors import ConfigError
from grpo import completion_texts, prompt_seed, rollout
from rewards import answer_reward, reference
from tasks.common import EvalConfig, cell, load


@dataclasses.dataclass
class PassConfig(EvalConfig):
    # --- data
    data_path: str = "data/rl_val.jsonl"  # train_grpo.py's prompts: {"conversations", "answer" or "gt"}, held out
    max_records: int | None = None  # the first this many prompts; None: all
    # --- generation
    k: int = 8  # sampled completions per prompt: pass@1 and pass@k are estimated from them
    temperature: float = 1.0  # of the sampled completions (pass@1 greedy is also reported)
    max_new_tokens: int = 256
    samples: int = 5  # prompts whose greedy answer is kept in full

    def __post_init__(self):
        super().__post_init__()
        if self.k < 1 or self.max_new_tokens < 1 or self.temperature <= 0:
            raise ConfigError(f"config keys 'k' and 'max_new_tokens' must be at least 1 and 'temperature' above 0, got "
                              f"{self.k}, {self.max_new_tokens}, {self.temperature}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k completions drawn from n, c of them right, is right (Chen et al. 2021's
    unbiased estimator): 1 - C(n - c, k) / C(n, k)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(cfg: PassConfig) -> tuple[dict, dict]:
    """(the report's section, the checkpoint's state)."""
    model, tokenizer, state, run = load(cfg)
    prompts = read_prompts(cfg.data_path, tokenizer, model.config.max_seq_len - cfg.max_new_tokens,
                           need_reference=True, verbose=False)[: cfg.max_records]
    greedy, correct = [], []  # greedy: (text, right?) per prompt; correct: right sampled completions per prompt
    for start in range(0, len(prompts), cfg.batch_size):
        chunk = prompts[start : start + cfg.batch_size]
        ids, seeds = [p.ids for p in chunk], [prompt_seed(cfg.seed, 0, start + i) for i in range(len(chunk))]
        with run.autocast():
            rows = rollout(model, ids, None, 1, cfg.max_new_tokens, tokenizer.eos_id)
            sampled = rollout(model, ids, seeds, cfg.k, cfg.max_new_tokens, tokenizer.eos_id, cfg.temperature)
        texts = completion_texts(tokenizer, sampled)
        for i, (p, text) in enumerate(zip(chunk, completion_texts(tokenizer, rows))):
            greedy.append((text, answer_reward(text, reference(p.record))))
            correct.append(sum(answer_reward(t, reference(p.record)) for t in texts[i * cfg.k : (i + 1) * cfg.k]))
    n = len(prompts)
    result = {"data_path": cfg.data_path, "prompts": n, "k": cfg.k, "temperature": cfg.temperature,
              "max_new_tokens": cfg.max_new_tokens, "greedy_pass1": sum(right for _, right in greedy) / n,
              "pass1": sum(pass_at_k(cfg.k, int(c), 1) for c in correct) / n,
              "passk": sum(pass_at_k(cfg.k, int(c), cfg.k) for c in correct) / n,
              "samples": [{"line": p.where.rsplit(":", 1)[1], "prompt": p.messages[-1]["content"],
                           "reference": reference(p.record), "answer": text}
                          for p, (text, _) in list(zip(prompts, greedy))[: cfg.samples]]}
    print(f"{cfg.data_path}, {n} prompts: pass@1 greedy {result['greedy_pass1']:.1%} | sampled at temperature "
          f"{cfg.temperature}: pass@1 {result['pass1']:.1%}, pass@{cfg.k} {result['passk']:.1%}")
    return result, state


def render(s: dict) -> list[str]:
    md = ["## Final answers (pass@k)", "", f"On the {s['prompts']} prompts of `{s['data_path']}`: does the completion's "
          f"final answer (its last number, when the reference is one) equal the reference? At most "
          f"{s['max_new_tokens']} new tokens; {s['k']} sampled completions per prompt at temperature {s['temperature']}.",
          "", "| metric | value |", "|---|---:|", f"| pass@1, greedy | {s['greedy_pass1']:.1%} |",
          f"| pass@1, sampled | {s['pass1']:.1%} |", f"| pass@{s['k']}, sampled | {s['passk']:.1%} |", "",
          "| # | prompt | reference | greedy answer |", "|---|---|---|---|"]
    return md + [f"| {x['line']} | {cell(x['prompt'])} | {cell(x['reference'])} | {cell(x['answer'])} |"
                 for x in s["samples"]]
