# GRPO of the demo SFT model (configs/demo_sft.py) on doubling ("What is double 7?", "7的两倍是多少？"), which no
# SFT conversation asks; rewarded when the answer's last number is the double (reward, below). The held-out prompts
# ask about numbers the training prompts never do (prepare_demo.py).
out_dir = "out/demo/grpo"
init_from = "out/demo/sft/best.pt"
data_path = "data/demo/grpo.jsonl"
val_data_path = "data/demo/grpo_eval.jsonl"
flash = True  # see configs/demo.py
freeze_embeddings = True  # as in configs/demo_sft.py
# the right double (1), and 0.5 for adding the asked number to itself ("7 + 7"), the step that carries over to
# numbers training never asks about (demo_data.doubled_operands)
reward = "answer,demo_data:doubled_operands"
group_size = 8
temperature = 1.0
max_new_tokens = 16  # "7 + 7 = 14." is 8 tokens
loss_type = "grpo"
ppo_epochs = 2  # two clipped updates per rollout batch
# no KL to the SFT model: with beta 0.1 (MiniMind's), 16 prompts and one update, held-out pass@1 was 65% after 30
# steps instead of 87.5%
beta = 0.0
# 32 prompts x 8 completions per step, 100 steps: a lighter schedule leaves some pretraining seeds far below
# (docs/rl.md)
batch_size = 32
max_steps = 100
# no early stop within the 100 steps: 120 prompts make an epoch of 3-4 steps, each ending in an evaluation, and a run
# may stall for 30 steps (10 evaluations, GRPO's default patience) before it climbs again
early_stopping_patience = 100
lr = 1e-4
min_lr = 1e-5
warmup_steps = 5
log_interval = 5
eval_interval = 10
eval_steps = 10
save_interval = 1000
keep_checkpoints = 1
