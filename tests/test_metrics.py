"""metrics.py: the console line is short and in human units, for every stage's training rows and for evaluations."""
from metrics import console_line


def test_the_console_line_is_short_and_in_human_units():
    row = {"step": 120, "loss": 2.3101, "ppl": 10.08, "lr": 3e-4, "grad_norm": 0.8412, "reward_margin": 1.234,
           "reward_acc": 0.953, "chosen_reward": 0.1, "rejected_reward": -1.1, "chosen_logp": -50.0,
           "rejected_logp": -60.0, "skipped_steps": 2, "tokens_per_s": 9612.0, "mfu": 0.6312, "mem_gb": 1.4,
           "frac_data": 0.001, "frac_forward": 0.33, "frac_backward": 0.6, "frac_optimizer": 0.069,
           "elapsed_s": 252.7, "eta_s": 3725.1}
    line = console_line(row, 650)
    assert line == ("step 120/650 | loss 2.31 | lr 3.0e-04 | grad 0.841 | acc 95% margin 1.23 | 9.6k tok/s | "
                    "MFU 63% | 0:04:12 / ETA 1:02:05")
    assert len(line) <= 120
    pretrain = {k: v for k, v in row.items() if not k.startswith(("reward", "chosen", "rejected"))}
    assert console_line(pretrain, 650) == ("step 120/650 | loss 2.31 | lr 3.0e-04 | grad 0.841 | 9.6k tok/s | "
                                           "MFU 63% | 0:04:12 / ETA 1:02:05")
    assert console_line({**pretrain, "tokens_per_s": 950.4}, 650).split(" | ")[4] == "950 tok/s"
    evaluation = console_line({"step": 325, "val_loss": 2.1101, "val_ppl": 8.249}, 650)
    assert evaluation == "step 325/650 | val_loss 2.11 | val_ppl 8.249"
