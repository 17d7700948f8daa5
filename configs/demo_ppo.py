# PPO with a critic of the demo SFT model (configs/demo_sft.py) on configs/demo_grpo.py's doubling task: its prompts
# and answer reward on a lighter schedule (16 prompts x 8 completions per step, one update, 60 steps). GRPO with the
# same settings (train_grpo.py configs/demo_grpo.py --reward=answer --batch_size=16 --ppo_epochs=1 --max_steps=60)
# is what it compares with, on one thing: where the baseline comes from, the group's mean or the value model.
out_dir = "out/demo/ppo"
init_from = "out/demo/sft/best.pt"
data_path = "data/demo/grpo.jsonl"
val_data_path = "data/demo/grpo_eval.jsonl"
flash = True  # see configs/demo.py
freeze_embeddings = True  # as in configs/demo_sft.py (the critic's copy keeps them frozen too)
reward = "answer"
group_size = 8
temperature = 1.0
max_new_tokens = 16  # "7 + 7 = 14." is 8 tokens
beta = 0.0  # as GRPO's demo: no KL to the SFT model
ppo_epochs = 1
critic_lr = 1e-3
critic_min_lr = 1e-4
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
