"""
Write the synthetic bilingual demo data set (demo_data.py's world): small, seeded, and checkable.

Its world is the capital cities and continents of 103 countries and the sums of two numbers below 20, in
English and Chinese. Pretraining text states every fact (held-out ones included) many times: as sentences in
paragraphs about one country, as runs of sums, and as FAQ-style questions with their answers. SFT conversations
and DPO pairs never mention the held-out countries and sums; eval.jsonl asks about them. So the evaluation
measures whether SFT taught the model to answer in the chat template with what pretraining knew.

    python prepare_demo.py            # -> data/demo/{pretrain,sft,dpo,dpo_eval,eval,eval_sft,grpo,grpo_eval}.jsonl
                                      #    and data/demo/tools_{pretrain,sft,rl,eval}.jsonl (the calculator task)

It is synthetic: real training uses MiniMind-format files (see README).
"""
import os
import random
from dataclasses import dataclass

from config import load_config
from demo_data import (SUM_DOUBLES, TOOL_Q, conversation, documents, double_prompts, dpo_pair, eval_questions,
                       product_document, split_world, tool_pairs, tool_record, write_jsonl)
from errors import check_ranges, cli
from tools import load_toolbox


@dataclass
class Config:
    # --- I/O
    out_dir: str = "data/demo"
    seed: int = 1337
    # --- the world
    max_number: int = 20  # sums of two numbers below this
    held_out_countries: int = 20
    held_out_sums: float = 0.1  # fraction of number pairs held out
    sum_doubles: float = SUM_DOUBLES  # share of the pretraining's sum paragraphs that are a + a
    # --- how many records
    pretrain_docs: int = 30000  # pretraining documents
    sft: int = 8000  # SFT conversations
    dpo: int = 3000  # DPO pairs
    eval_sums: int = 150  # held-out sum questions in eval.jsonl
    # --- the tool task
    tool_docs: int = 30000  # pretraining documents of the tool task
    tool_sft: int = 3000  # tool-calling conversations (products of two numbers)
    tool_rl: int = 600  # tool-use RL prompts, about other products
    tool_eval: int = 100  # held-out tool-use prompts

    def __post_init__(self):
        check_ranges(self, {"sum_doubles": (lambda v: 0 <= v <= 1, "in [0, 1]")})


def main(argv: list[str]):
    (args,) = load_config(argv, Config)

    rng = random.Random(args.seed)
    held_countries, train_countries, held_pairs, train_pairs = split_world(rng, args.held_out_countries,
                                                                           args.max_number, args.held_out_sums)
    os.makedirs(args.out_dir, exist_ok=True)
    docs = documents(args.pretrain_docs, args.max_number, rng, args.sum_doubles)
    write_jsonl(f"{args.out_dir}/pretrain.jsonl", ({"text": d} for d in docs))
    write_jsonl(f"{args.out_dir}/sft.jsonl", (conversation(rng, train_countries, train_pairs) for _ in range(args.sft)))
    write_jsonl(f"{args.out_dir}/dpo.jsonl",
                (dpo_pair(rng, train_countries, train_pairs, as_messages=i % 2 == 1) for i in range(args.dpo)))
    write_jsonl(f"{args.out_dir}/dpo_eval.jsonl",
                (dpo_pair(rng, held_countries, held_pairs, as_messages=False) for _ in range(200)))
    evals = eval_questions(rng, held_countries, held_pairs[: args.eval_sums])
    write_jsonl(f"{args.out_dir}/eval.jsonl", evals)
    write_jsonl(f"{args.out_dir}/eval_sft.jsonl",  # the same, as SFT conversations: for eval.py sft
                ({"conversations": [{"role": "user", "content": e["question"]},
                                    {"role": "assistant", "content": e["answer"]}]} for e in evals))
    numbers = list(range(args.max_number))  # RL: doubling, its own random stream (the files above stay as they were)
    random.Random(args.seed + 1).shuffle(numbers)
    held = args.max_number // 4
    rl_train, rl_eval = double_prompts(sorted(numbers[held:])), double_prompts(sorted(numbers[:held]))
    random.Random(args.seed + 2).shuffle(rl_train)  # mixed in the file, so that its last val_fraction is any
    write_jsonl(f"{args.out_dir}/grpo.jsonl", rl_train)
    write_jsonl(f"{args.out_dir}/grpo_eval.jsonl", rl_eval)
    # tool use: products of two-digit numbers, which the model answers by calling the calculator; SFT, RL and the
    # evaluation each ask about their own products (a stream of its own again)
    rng = random.Random(args.seed + 3)
    schemas = load_toolbox("calculate_math").schemas
    pairs = tool_pairs(rng, args.tool_sft + args.tool_rl + args.tool_eval)
    rng.shuffle(pairs)
    ask = lambda a, b, phrasings: rng.choice(phrasings).format(a=a, b=b)  # noqa: E731
    sft_pairs, rl_pairs = pairs[: args.tool_sft], pairs[args.tool_sft : args.tool_sft + args.tool_rl]
    write_jsonl(f"{args.out_dir}/tools_pretrain.jsonl",
                ({"text": product_document(rng, schemas)} for _ in range(args.tool_docs)))
    write_jsonl(f"{args.out_dir}/tools_sft.jsonl",  # SFT's five phrasings; RL and the evaluation ask all eight
                [tool_record(a, b, ask(a, b, TOOL_Q[:5]), schemas) for a, b in sft_pairs])
    write_jsonl(f"{args.out_dir}/tools_rl.jsonl",
                [tool_record(a, b, ask(a, b, TOOL_Q), schemas, False) for a, b in rl_pairs])
    write_jsonl(f"{args.out_dir}/tools_eval.jsonl", [tool_record(a, b, ask(a, b, TOOL_Q), schemas, False)
                                                     for a, b in pairs[args.tool_sft + args.tool_rl :]])
    print(f"wrote {args.out_dir}/: {len(docs)} pretraining documents, {args.sft} conversations, "
          f"{args.dpo} + 200 DPO pairs, {len(evals)} held-out questions, {len(rl_train)} + {len(rl_eval)} RL prompts, "
          f"{args.tool_docs} + {args.tool_sft} + {args.tool_rl} + {args.tool_eval} tool-task documents, conversations and "
          "prompts")


if __name__ == "__main__":
    cli(main)
