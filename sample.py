"""
Talk to a trained model.

    python sample.py --ckpt out/sft/best.pt --prompt "What is the capital of France?"   # one answer
    python sample.py --ckpt out/sft/best.pt                                             # multi-turn chat
    python sample.py --ckpt out/pretrain/best.pt --prompt "The capital of"              # plain continuation

SFT and DPO checkpoints answer in the chat template, keeping the conversation history; a pretraining
checkpoint continues the text it is given. Generation streams token by token and uses the KV cache.
"""
import argparse
import sys

import torch

from checkpoint import load_model
from engine import Sampling, TextStream, generate, prompt_ids
from errors import ConfigError, cli
from runtime import DTYPES, open_device


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
    max_new_tokens = args.max_new_tokens or model.config.max_seq_len - len(ids)
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


def chat_loop(model, tokenizer, args, chat: bool, read=input, out=sys.stdout,
              generator: torch.Generator | None = None) -> list[dict]:
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
        ids = prompt_ids(tokenizer, history + [{"role": "user", "content": user}] if chat else user, args.system, budget)
        answer = respond(model, tokenizer, ids, args, out, generator)
        if chat:
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": answer or "..."}]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a checkpoint written by train_pretrain/sft/dpo/distill.py "
                                                  "(a LoRA one is merged onto its base)")
    p.add_argument("--prompt", help="answer this once and exit; without it, chat interactively")
    p.add_argument("--system", help="system prompt (chat checkpoints)")
    p.add_argument("--tokenizer_path", help="default: the checkpoint's (its chat template comes with it)")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--top_p", type=float, default=0.9)
    p.add_argument("--repetition_penalty", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=None,
                   help="default: up to the end of the model's context (the prompt keeps at most half of it)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="autocast: auto is what the device runs well (float32 on a CPU); float32 forces it")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    run = open_device(args.device, args.dtype)
    model, tokenizer, state = load_model(args.ckpt, run.device, args.tokenizer_path)
    generator = torch.Generator(run.device).manual_seed(args.seed)  # on the device it samples on
    chat = state["stage"] != "pretrain"
    budget = prompt_budget(model.config.max_seq_len, args.max_new_tokens)
    if args.prompt is not None:
        message = [{"role": "user", "content": args.prompt}] if chat else args.prompt
        with run.autocast():
            respond(model, tokenizer, prompt_ids(tokenizer, message, args.system, budget), args, sys.stdout, generator)
        return
    mode = f"chat in the {tokenizer.chat_template} template" if chat else "plain continuation"
    print(f"{state['stage']} checkpoint {args.ckpt}: {mode}; Ctrl-C stops an answer, Ctrl-D or Ctrl-C at the prompt quits")
    with run.autocast():
        chat_loop(model, tokenizer, args, chat, generator=generator)


if __name__ == "__main__":
    cli(main)
