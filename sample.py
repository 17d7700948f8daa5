"""
Talk to a trained model.

    python sample.py --ckpt=out/sft/best.pt --prompt="What is the capital of France?"   # one answer
    python sample.py --ckpt=out/sft/best.pt                                             # multi-turn chat
    python sample.py --ckpt=out/pretrain/best.pt --prompt="The capital of"              # plain continuation
    python sample.py --ckpt=out/sft/best.pt --tools=builtin --prompt="What is 37 times 48?"   # with tools

SFT and DPO checkpoints answer in the chat template, keeping the conversation history; a pretraining
checkpoint continues the text it is given. Generation streams token by token and uses the KV cache.
With --tools the model is offered tools (ChatML template only); each call it writes is run, shown as
[call] and [result] lines, and the model goes on from the result, at most --max_turns turns per message.
"""
import dataclasses
import json
import sys

import torch

from checkpoint import load_model
from config import check_device_and_dtype, load_config
from engine import Sampling, TextStream, compiled, generate, prompt_ids
from errors import ConfigError, cli
from reply import CALL_START, Reply
from runtime import open_device
from tools import Toolbox, load_toolbox, take_turns


def prompt_budget(max_seq_len: int, max_new_tokens: int | None) -> int:
    """How many ids the prompt may keep: what --max_new_tokens leaves of the context, or by default half of it
    (the answer then gets all the prompt leaves, so a default fits any model)."""
    if max_new_tokens is None:
        return max(max_seq_len // 2, 1)
    if not 0 < max_new_tokens < max_seq_len:
        raise ConfigError(f"--max_new_tokens must be between 1 and the model's max_seq_len - 1 ({max_seq_len - 1}): "
                          f"got {max_new_tokens}; leave it out to answer up to the end of the context")
    return max_seq_len - max_new_tokens


def respond(model, tokenizer, ids: list[int], args, out=None, generator: torch.Generator | None = None) -> str:
    """Generate an answer to ids, streaming its text to out (if given); returns the text without the template's
    surrounding spaces. Ctrl-C stops the answer early. generator: the random draws (None: torch's global one)."""
    max_seq_len = model.config.max_seq_len  # a tool turn's prompt may take more than the budget: cap to what is left
    max_new_tokens = min(args.max_new_tokens or max_seq_len, max_seq_len - len(ids))
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty, generator)
    text = TextStream(tokenizer)
    try:
        for (row,) in generate(model, [ids], max_new_tokens, sampling, tokenizer.eos_id):
            if row.finish_reason == "stop":  # its end of turn
                break
            new = text.add(row.tokens[-1])
            if out is not None and new:
                out.write(new)
                out.flush()
    except KeyboardInterrupt:
        if out is not None:
            out.write(" [interrupted]")
    rest = text.finish()
    if out is not None:
        out.write(rest + "\n")
    return text.sent


def answer(model, tokenizer, messages: list[dict], args, budget: int, toolbox: Toolbox | None = None, out=None,
           generator: torch.Generator | None = None) -> list[dict]:
    """Answer a conversation that ends with the user's message; returns the messages the answer adds. With a
    toolbox, a turn that calls tools is followed by their results and a new turn from the whole history, up to
    args.max_turns turns (tools.take_turns): [assistant + tool_calls, tool, ..., assistant]."""
    if toolbox is None:
        text = respond(model, tokenizer, prompt_ids(tokenizer, messages, args.system, budget), args, out, generator)
        return [{"role": "assistant", "content": text or "..."}]
    chat = PrintedTurns(model, tokenizer, messages, args, budget, toolbox, out, generator)
    if chat.ids is None:
        chat.end(chat, "length", None)
    else:
        take_turns([chat], toolbox, args.max_turns, chat)
    return chat.added


class PrintedTurns:
    """The CLI's side of tools.take_turns, for one conversation (its own chat): a turn is prompted from the whole
    history as messages and streamed to out (respond), each call and its result shown. The message's own turns are
    never cut: past the budget they take the prompt alone, and a turn gets what the context has left (as in
    tools.converse)."""

    def __init__(self, model, tokenizer, messages: list[dict], args, budget: int, toolbox: Toolbox, out, generator):
        self.model, self.tokenizer, self.messages, self.args, self.budget = model, tokenizer, messages, args, budget
        self.tools, self.out, self.generator = toolbox.schemas, out, generator
        self.added: list[dict] = []  # what the answer adds to the messages
        self.text = ""  # the last turn's text
        self.ids = self.prompt()

    def prompt(self) -> list[int] | None:
        """The next turn's prompt, or None when this message's turns alone fill the model's context."""
        ids = prompt_ids(self.tokenizer, self.messages + self.added, self.args.system, self.budget, tools=self.tools)
        current = prompt_ids(self.tokenizer, self.messages[-1:] + self.added, self.args.system, tools=self.tools)
        if len(current) >= self.model.config.max_seq_len:
            return None
        return current if len(current) > self.budget else ids

    def show(self, text: str):
        if self.out is not None:
            self.out.write(text)

    def write(self, chats) -> list[tuple[str, str]]:
        self.text = respond(self.model, self.tokenizer, self.ids, self.args, self.out, self.generator)
        return [(self.text, "stop")]  # the CLI goes on from a turn however it ended (Ctrl-C, --max_new_tokens)

    def wrote(self, chat, text: str, reply: Reply):
        if reply.malformed:
            self.show(f"[malformed] {reply.malformed} {CALL_START} block(s) that are not a call: kept as text\n")

    def read(self, chat, reply: Reply, results: list[str]) -> bool:
        self.added.append(reply.as_message())
        for call, result in zip(reply.calls, results):
            self.show(f"[call] {call['name']}({json.dumps(call['arguments'], ensure_ascii=False)})\n"
                      f"[result] {result}\n")
            self.added.append({"role": "tool", "content": result})
        self.show("bot> ")
        self.ids = self.prompt()
        return self.ids is not None

    def end(self, chat, reason: str, reply: Reply | None):
        if reason == "turns":
            self.added.append(reply.as_message())
            self.show(f"[stopped] {self.args.max_turns} turns and still calling tools: these calls were not run "
                      "(--max_turns)\n")
        elif reason == "length":
            self.show(f"[stopped] this message, its calls and their results fill the model's context of "
                      f"{self.model.config.max_seq_len} tokens\n")
        else:
            self.added.append({"role": "assistant", "content": self.text or "..."})


def chat_loop(model, tokenizer, args, chat: bool, read=input, out=sys.stdout,
              generator: torch.Generator | None = None, toolbox: Toolbox | None = None) -> list[dict]:
    """Read a line, answer it, repeat; Ctrl-D or Ctrl-C at the prompt ends. Returns the conversation."""
    history: list[dict] = []
    budget = prompt_budget(model.config.max_seq_len, args.max_new_tokens)
    while True:
        try:
            user = read("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return history
        if not user:
            continue
        out.write("bot> ")
        if chat:
            asked = history + [{"role": "user", "content": user}]
            history = asked + answer(model, tokenizer, asked, args, budget, toolbox, out, generator)
        else:
            respond(model, tokenizer, prompt_ids(tokenizer, user, max_len=budget), args, out, generator)


@dataclasses.dataclass
class Config:
    # --- I/O
    ckpt: str | None = None  # required: a checkpoint of train_pretrain/sft/dpo/distill.py (LoRA: merged onto its base)
    prompt: str | None = None  # answer this once and exit; None: chat interactively
    system: str | None = None  # system prompt (chat checkpoints)
    tokenizer_path: str | None = None  # None: the checkpoint's (its chat template comes with it)
    yarn: float | None = None  # FACTOR: a context FACTOR times the trained one, by YaRN rope scaling
    # --- tools
    tools: str | None = None  # offer tools, run the calls: builtin | calculate_math,... (built-ins) | file.py | module
    max_turns: int = 5  # with tools: model turns per message, at most
    # --- sampling
    temperature: float = 0.7  # 0 = greedy
    top_k: int | None = None
    top_p: float = 0.9
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None  # None: up to the end of the context (the prompt keeps at most half of it)
    seed: int = 1337
    # --- system
    device: str = "auto"  # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # autocast: auto is what the device runs well (float32 on a CPU); float32 forces it
    compile: bool = False  # torch.compile the forward: a compile at the first answer; 26m then decodes 1.4-2.2x faster

    def __post_init__(self):
        check_device_and_dtype(self.device, self.dtype)


def parse_args(argv: list[str]) -> Config:
    (cfg,) = load_config(argv, Config)
    if cfg.ckpt is None:
        raise ConfigError("sample.py needs --ckpt=PATH: the checkpoint to talk to")
    return cfg


def main(argv: list[str]):
    args = parse_args(argv)
    run = open_device(args.device, args.dtype)
    model, tokenizer, state = load_model(args.ckpt, run.device, args.tokenizer_path, args.yarn)
    model = compiled(model) if args.compile else model
    generator = torch.Generator(run.device).manual_seed(args.seed)  # on the device it samples on
    chat = state["stage"] != "pretrain"
    budget = prompt_budget(model.config.max_seq_len, args.max_new_tokens)
    toolbox = offered_tools(args, tokenizer, chat, model.config.max_seq_len)
    if args.prompt is not None:
        with run.autocast():
            if chat:
                answer(model, tokenizer, [{"role": "user", "content": args.prompt}], args, budget, toolbox,
                       sys.stdout, generator)
            else:
                ids = prompt_ids(tokenizer, args.prompt, max_len=budget)
                respond(model, tokenizer, ids, args, sys.stdout, generator)
        return
    mode = f"chat in the {tokenizer.chat_template} template" if chat else "plain continuation"
    mode += f", tools {', '.join(toolbox.functions)}" if toolbox else ""
    print(f"{state['stage']} checkpoint {args.ckpt}: {mode}; Ctrl-C stops an answer, Ctrl-D or Ctrl-C at the prompt quits")
    with run.autocast():
        chat_loop(model, tokenizer, args, chat, generator=generator, toolbox=toolbox)


def offered_tools(args, tokenizer, chat: bool, max_seq_len: int) -> Toolbox | None:
    """--tools' toolbox (None without it), once the checkpoint is known to be able to show tools and their
    descriptions to leave room in its context."""
    if args.tools is None:
        return None
    if args.max_turns < 1:
        raise ConfigError(f"--max_turns must be at least 1, got {args.max_turns}")
    if not chat:
        raise ConfigError("--tools needs a chat checkpoint (SFT, DPO, ...): a pretrained one continues plain text")
    if tokenizer.chat_template != "chatml":
        raise ConfigError(f"--tools: this checkpoint's tokenizer has the {tokenizer.chat_template} chat template, "
                          "which cannot show tools (MiniMind's ChatML template can)")
    toolbox = load_toolbox(args.tools)
    need = len(prompt_ids(tokenizer, [{"role": "user", "content": ""}], args.system, tools=toolbox.schemas))
    if need >= max_seq_len:
        raise ConfigError(f"--tools: the tools' descriptions take {need} tokens, and the model's whole context is "
                          f"{max_seq_len}: offer fewer tools")
    return toolbox


if __name__ == "__main__":
    cli(main)
