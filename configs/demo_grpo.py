# GRPO of the demo SFT model (configs/demo_sft.py) on doubling ("What is double 7?", "7的两倍是多少？"), which no
# SFT conversation asks; rewarded 1 when the answer's last number is the double. The held-out prompts ask about
# numbers the training prompts never do (prepare_demo.py).
out_dir = "out/demo/grpo"
init_from = "out/demo/sft/best.pt"
data_path = "data/demo/grpo.jsonl"
val_data_path = "data/demo/grpo_eval.jsonl"
flash = True  # see configs/demo.py
freeze_embeddings = True  # as in configs/demo_sft.py
reward = "answer"
group_size = 8
temperature = 1.0
max_new_tokens = 16  # "7 + 7 = 14." is 8 tokens
loss_type = "cispo"  # with one update per rollout batch (ppo_epochs=1) grpo's gradient is the same, exactly
# no KL to the SFT model: with beta 0.1 (MiniMind's) held-out pass@1 was 65% after 30 steps instead of 87.5%
beta = 0.0
batch_size = 16
max_steps = 60
lr = 1e-4
min_lr = 1e-5
warmup_steps = 5
log_interval = 5
eval_interval = 10
eval_steps = 10
save_interval = 1000
keep_checkpoints = 1
