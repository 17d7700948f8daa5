"""eval.py toolcall: conversations with tools offered, answered greedily with the calls run between turns
(tools.converse): the final answer against the reference, and how the model calls."""
import dataclasses
import json
from collections import Counter

from chat import chatml_messages
from data import read_prompts
from engine import GREEDY
from errors import ConfigError, DataError
from reply import parse_reply, written_calls
from rewards import answer_reward, reference
from tasks.common import EvalConfig, cell, load
from tools import call_problem, check_tools, converse, load_toolbox


@dataclasses.dataclass
class ToolCallConfig(EvalConfig):
    # --- data
    data_path: str = "data/tool_eval.jsonl"  # {"conversations": [system with "tools", user], "gt" or "answer"}
    max_records: int | None = None  # the first this many records; None: all
    tools: str = "builtin"  # what runs the calls: builtin, built-in names, or a file.py / module of your functions
    # --- generation (greedy)
    max_turns: int = 3  # model turns per conversation, at most (calls, their results, ..., the answer)
    max_new_tokens: int = 64  # per turn
    samples: int = 5  # conversations kept in full, every turn

    def __post_init__(self):
        super().__post_init__()
        if self.max_turns < 1 or self.max_new_tokens < 1:
            raise ConfigError(f"config keys 'max_turns' and 'max_new_tokens' must be at least 1, got {self.max_turns}"
                              f" and {self.max_new_tokens}")


def offered_functions(p, toolbox, spec: str) -> dict[str, dict]:
    """The functions a record offers ({name: description}), each one the toolbox can run; and a list gt that holds
    something to look for."""
    _, tools = chatml_messages(p.messages)
    functions = check_tools(tools or [], f"{p.where}: tools")
    missing = [name for name in functions if name not in toolbox.functions]
    if missing:
        raise DataError(f"{p.where}: the record offers the tool {missing[0]!r}, which --tools={spec} cannot run "
                        f"(it has {', '.join(toolbox.functions)}); pass --tools=a file.py or module defining it")
    expected = p.record.get("answer", p.record.get("gt"))
    if isinstance(expected, list) and (not expected or not all(isinstance(x, (str, int, float)) for x in expected)):
        raise DataError(f"{p.where}: a list 'gt' must hold at least one string or number to find in the answer")
    return functions


def answer_right(answer: str, record: dict) -> bool:
    """The final answer against the record's reference (rewards.answer_reward); a list (MiniMind's gt) only when
    every item is in it -- a number among its numbers, by value; text, ignoring case."""
    return answer_reward(answer, reference(record)) == 1.0


def conversation_score(p, t, functions: dict[str, dict]) -> dict:
    """One trajectory's figures: every call it wrote (run or not: the last turn's are not), how many fit the
    functions offered, and whether it answered right."""
    calls, _ = written_calls(t.messages[len(p.messages):], t.text)  # the blocks that were not: t.malformed
    return {"calls": len(calls), "fitting": sum(call_problem(c, functions) is None for c in calls),
            "right": t.finish_reason == "stop" and answer_right(parse_reply(t.text).content, p.record)}


def steps_of(p, t) -> list[list[str]]:
    """A trajectory for a person: [kind, text] for each thing said after the prompt, the last turn last."""
    steps = []
    for m in t.messages[len(p.messages):]:
        if m["role"] == "tool":
            steps.append(["result", m["content"]])
            continue
        steps += [["assistant", m["content"]]] if m.get("content") else []
        steps += [["call", f"{c['name']}({json.dumps(c['arguments'], ensure_ascii=False)})"] for c in m["tool_calls"]]
    return steps + [["answer" if t.finish_reason == "stop" else f"last turn ({t.finish_reason})", t.text]]


def reference_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def evaluate(cfg: ToolCallConfig) -> tuple[dict, dict]:
    """(the report's section, the checkpoint's state)."""
    model, tokenizer, state, run = load(cfg)
    T = model.config.max_seq_len
    if tokenizer.chat_template != "chatml":
        raise ConfigError(f"{cfg.ckpt}: its tokenizer's {tokenizer.chat_template} chat template cannot show tools; "
                          "toolcall needs a checkpoint with MiniMind's ChatML one")
    if cfg.max_new_tokens >= T:
        raise ConfigError(f"config key 'max_new_tokens' must be below the model's max_seq_len ({T}), got "
                          f"{cfg.max_new_tokens}")
    toolbox = load_toolbox(cfg.tools)
    prompts = read_prompts(cfg.data_path, tokenizer, T - cfg.max_new_tokens, need_reference=True,
                           verbose=False)[: cfg.max_records]
    functions = [offered_functions(p, toolbox, cfg.tools) for p in prompts]
    trajectories = []
    for start in range(0, len(prompts), cfg.batch_size):
        chunk = [(p.ids, p.messages, GREEDY) for p in prompts[start : start + cfg.batch_size]]
        with run.autocast():
            trajectories += converse(model, tokenizer, chunk, toolbox, cfg.max_turns, cfg.max_new_tokens)
    scores = [conversation_score(p, t, f) for p, t, f in zip(prompts, trajectories, functions)]
    n, calls, malformed = len(prompts), sum(s["calls"] for s in scores), sum(t.malformed for t in trajectories)
    result = {"data_path": cfg.data_path, "records": n, "tools": cfg.tools, "max_turns": cfg.max_turns,
              "max_new_tokens": cfg.max_new_tokens, "answer_acc": sum(s["right"] for s in scores) / n,
              "called": sum(s["calls"] > 0 for s in scores) / n, "calls": calls, "malformed": malformed,
              "call_fit": sum(s["fitting"] for s in scores) / (calls + malformed) if calls + malformed else None,
              "mean_turns": sum(t.turns for t in trajectories) / n,
              "unfinished": sum(t.finish_reason != "stop" for t in trajectories) / n,
              "finish_reasons": dict(Counter(t.finish_reason for t in trajectories)),
              "samples": [{"line": p.where.rsplit(":", 1)[1], "prompt": p.messages[-1]["content"],
                           "reference": p.record.get("answer", p.record.get("gt")), "steps": steps_of(p, t),
                           "right": s["right"]}
                          for p, t, s in list(zip(prompts, trajectories, scores))[: cfg.samples]]}
    for i, x in enumerate(result["samples"], 1):
        print(f"--- sample {i} ({cfg.data_path}:{x['line']}, {'right' if x['right'] else 'wrong'})\n"
              f"prompt:    {x['prompt']}\nreference: {reference_text(x['reference'])}")
        print("\n".join(f"{kind + ':':<10} {text}" for kind, text in x["steps"]))
    fit = f"{result['call_fit']:.1%}" if result["call_fit"] is not None else "-"
    print(f"{cfg.data_path}, {n} conversations: answers right {result['answer_acc']:.1%} | called a tool "
          f"{result['called']:.1%} | calls that fit {fit} of {calls + malformed} | mean turns "
          f"{result['mean_turns']:.2f} | unfinished {result['unfinished']:.1%}")
    return result, state


def render(s: dict) -> list[str]:
    fit = f"{s['call_fit']:.1%}" if s["call_fit"] is not None else "-"
    md = ["## Tool calling", "", f"On the {s['records']} conversations of `{s['data_path']}`, answered greedily with "
          f"the tools offered, each call run by `--tools={s['tools']}` and its result read back; at most "
          f"{s['max_turns']} turns of at most {s['max_new_tokens']} new tokens.", "", "| metric | value |", "|---|---:|",
          f"| answers right (final answer against the reference) | {s['answer_acc']:.1%} |",
          f"| conversations with at least one call | {s['called']:.1%} |",
          f"| calls well-formed and fitting the tools offered ({s['calls'] + s['malformed']} `<tool_call>` blocks, "
          f"{s['malformed']} malformed) | {fit} |", f"| mean turns | {s['mean_turns']:.2f} |",
          f"| unfinished (out of turns or tokens) | {s['unfinished']:.1%} |", "",
          f"The first {len(s['samples'])} conversations (# = line), every turn:", "",
          "| # | prompt | reference | turns | right |", "|---|---|---|---|---|"]
    shown = lambda text: cell(text.replace("&", "&amp;").replace("<", "&lt;"))  # noqa: E731  <tool_call> shows
    for x in s["samples"]:
        steps = "<br>".join(f"*{kind}:* {shown(text)}" for kind, text in x["steps"])
        md.append(f"| {x['line']} | {shown(x['prompt'])} | {shown(reference_text(x['reference']))} | {steps} | "
                  f"{'yes' if x['right'] else 'no'} |")
    return md
