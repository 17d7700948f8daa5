"""
How good is a checkpoint? Six evaluations; each prints its figures and adds them to a report.

    python eval.py bpb --ckpt=out/pretrain/best.pt --data_path=data/pretrain_val.jsonl
    python eval.py sft --ckpt=out/sft/best.pt --data_path=data/sft_val.jsonl --max_records=200
    python eval.py choice --ckpt=out/sft/best.pt --task=ceval --data_dir=data/ceval-exam --shots=5
    python eval.py pairs --ckpt=out/reward/best.pt --data_path=data/dpo_eval.jsonl
    python eval.py pass --ckpt=out/grpo/best.pt --data_path=data/rl_val.jsonl --k=8
    python eval.py toolcall --ckpt=out/sft/best.pt --data_path=data/tool_eval.jsonl --tools=builtin
    python eval.py sft --help                                # every key of a sub-command, its default and meaning

bpb     bits per byte of a pretraining-format file: the summed cross-entropy in bits over the UTF-8 bytes of the
        scored tokens (special tokens count 0 bytes), so models with different tokenizers compare.
sft     held-out conversations: perplexity of the assistant tokens (the training loss), the model's answer to each
        last user turn scored against the reference (BLEU-4, ROUGE-L F1, exact match), samples kept in full.
choice  multiple-choice accuracy on C-Eval, CMMLU, MMLU or ARC files as their projects distribute them.
pairs   a reward model (train_reward.py) on preference pairs: how often the chosen answer scores higher.
pass    RL prompts with reference answers (train_grpo.py's): pass@1 of greedy answers, pass@1 and pass@k of k
        sampled ones (the final answer, its last number when the reference is one, equal to the reference).
toolcall conversations with tools offered, answered greedily with the calls run between turns: the final answer
        against the reference, how many conversations call, how many calls are well-formed and fit the tools
        offered, turns taken, conversations left unfinished.

BLEU and ROUGE count Chinese characters one by one and other text word by word, punctuation split off.
Each run writes report.json and report.md into the checkpoint's directory (or --out): its figures, the sections
other sub-commands wrote there for the same checkpoint, the checkpoint's config, a training summary from its
metrics.jsonl and links to plot.py's pictures.
"""
from config import load_config
from errors import ConfigError, cli
from report import write_report
from tasks import bpb, choice, pairs, passk, sft, toolcall

COMMANDS = {  # sub-command: (its keys, its module: evaluate and render, as tasks/common.py states)
    "bpb": (bpb.BpbConfig, bpb), "sft": (sft.SFTEvalConfig, sft), "choice": (choice.ChoiceConfig, choice),
    "pairs": (pairs.PairsConfig, pairs), "pass": (passk.PassConfig, passk),
    "toolcall": (toolcall.ToolCallConfig, toolcall),
}
RENDER = {command: task.render for command, (_, task) in COMMANDS.items()}


def main(argv: list[str]):
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            print(__doc__)
            return
        raise ConfigError(f"the first argument must be a sub-command: {', '.join(COMMANDS)} (eval.py --help)")
    schema, task = COMMANDS[argv[0]]
    (cfg,) = load_config(argv[1:], schema)
    section, state = task.evaluate(cfg)
    key = argv[0] if argv[0] != "choice" else f"choice/{cfg.task}/{cfg.split}/{cfg.shots}-shot/{cfg.method}"
    write_report(cfg, state, key, section, RENDER)
    return section


if __name__ == "__main__":
    cli(main)
