# The demo's reward model: the demo SFT model (configs/demo_sft.py) with a score head, trained on the demo DPO pairs
# to score the chosen answer above the rejected one. train_grpo.py can take its best.pt as reward_model.
out_dir = "out/demo/reward"
init_from = "out/demo/sft/best.pt"
data_path = "data/demo/dpo.jsonl"
val_fraction = 0.05
max_prompt_length = 64
max_completion_length = 64
flash = True  # see configs/demo.py
freeze_embeddings = True  # as in configs/demo_sft.py: the held-out countries' names stay as pretraining left them
batch_size = 32
# 3 epochs (267 steps) at 1e-3, not the 1 epoch at 1e-5 of the defaults: a 1.6M-parameter model with a fresh head
# barely moves at 1e-5; 6 epochs swing less with the seed and take twice as long (docs/reward_model.md)
epochs = 3
lr = 1e-3
min_lr = 1e-4
log_interval = 50
eval_interval = 1000  # at each epoch end
eval_steps = 10
save_interval = 1000
keep_checkpoints = 1
