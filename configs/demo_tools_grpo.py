# Agent RL of the tool task's SFT model (configs/demo_tools_sft.py): each completion may call the calculator and read
# its result before answering (up to 3 turns); rewarded for the right product in the answer and for well-formed
# calls. RL and the held-out prompts ask about products no SFT conversation asks, in eight phrasings of which SFT
# saw five.
out_dir = "out/demo/tools_grpo"
init_from = "out/demo/tools_sft/best.pt"
data_path = "data/demo/tools_rl.jsonl"
val_data_path = "data/demo/tools_eval.jsonl"
flash = True
tools = "calculate_math"
max_turns = 3
reward = "answer,calls"
group_size = 8
temperature = 1.0
max_new_tokens = 40  # a call is ~30 tokens, "37 × 48 = 1776." 12
loss_type = "cispo"
beta = 0.0
batch_size = 8
max_steps = 60  # the new phrasings are learnt by steps 30-50 (docs/tools.md)
lr = 3e-4  # with 1e-4 one start of six gained nothing (docs/tools.md)
min_lr = 3e-5
warmup_steps = 5
log_interval = 5
eval_interval = 10
eval_steps = 13
save_interval = 1000
keep_checkpoints = 1
