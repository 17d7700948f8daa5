"""
Knowledge distillation: train a (smaller) student to match a trained teacher's next-token distributions as well
as the data's next tokens.

    python train_distill.py configs/demo_distill.py                   # the demo: a half-width student
    python train_distill.py --teacher=out/pretrain/best.pt --dim=256 --n_layers=8 --data_path=data/pretrain_hq.jsonl
    python train_distill.py --help                                    # every key, its default and meaning

The loss of a token that carries loss (every token of pretraining data; the answers of SFT data), with the
teacher's and the student's logits z_t, z_s and the temperature T (Hinton et al. 2015):
    loss = alpha * T^2 * KL(softmax(z_t / T) || softmax(z_s / T)) + (1 - alpha) * cross-entropy(z_s, target)
T > 1 shows the student how the teacher ranks the unlikely tokens too; T^2 keeps that term's gradient on the
scale of the cross-entropy's as T grows. The teacher runs in eval mode, without gradients, in the run's autocast
dtype. The student starts fresh from the model keys (as in pretraining) or from init_from.
"""
import torch
import torch.nn.functional as F

from checkpoint import (EarlyStopping, checkpoint_to_resume, model_from_checkpoint, prepare_training,
                        trained_tokenizer_path)
from config import DistillConfig, load_config
from data import pretrain_loaders, sft_loaders
from errors import ConfigError, cli
from losses import evaluate, perplexity
from metrics import experts_row
from model import ModelConfig, Transformer, aux_loss
from optim import get_lr, schedule_length, set_lr
from runtime import all_reduce_mean, all_reduce_sum, print0, print_run, setup, teardown
from tokenizer import load_tokenizer


ARCHITECTURE = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len", "ffn_dim", "rope_theta",
                "norm_eps", "tie_embeddings")  # ModelConfig's keys that init_from fixes; the others are switches


def distill_loss(student_logits, teacher_logits, ce, loss_mask, alpha: float, temperature: float):
    """(loss, KL, cross-entropy), each summed over the tokens that carry loss. Logits (B, T, V) in float32;
    ce (B, T) the student's per-token cross-entropy (from its forward); loss_mask (B, T)."""
    log_p_teacher = F.log_softmax(teacher_logits / temperature, dim=-1)
    log_p_student = F.log_softmax(student_logits / temperature, dim=-1)
    kl = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(dim=-1)  # (B, T)
    kl_sum, ce_sum = (kl * loss_mask).sum(), (ce * loss_mask).sum()
    return alpha * temperature**2 * kl_sum + (1 - alpha) * ce_sum, kl_sum.detach(), ce_sum.detach()


def student_model(cfg, model_cfg: ModelConfig, run) -> Transformer:
    """A fresh model of model_cfg, or init_from with model_cfg's switches (flash, grad_checkpoint, dropout); an
    architecture key set to something else than init_from's is an error."""
    if cfg.init_from is None:
        return Transformer(model_cfg).to(run.device)
    model, _ = model_from_checkpoint(cfg.init_from, run.device, flash=model_cfg.flash,
                                     grad_checkpoint=model_cfg.grad_checkpoint, dropout=model_cfg.dropout)
    default = ModelConfig()
    for key in ARCHITECTURE:
        if getattr(model_cfg, key) not in (getattr(default, key), getattr(model.config, key)):
            raise ConfigError(f"config key {key!r} is {getattr(model_cfg, key)}, but init_from {cfg.init_from} has "
                              f"{getattr(model.config, key)}: the student's architecture is init_from's")
    return model


def load_teacher(cfg, student: Transformer, run) -> Transformer:
    """The teacher in eval mode, frozen, with the student's attention path. It must share the run's tokenizer
    (the same files, not only the same size: KL compares distributions id by id) and vocabulary size."""
    teacher, state = model_from_checkpoint(cfg.teacher, run.device, flash=student.config.flash)
    taught_with = trained_tokenizer_path(state)
    if load_tokenizer(taught_with).fingerprint != load_tokenizer(cfg.tokenizer_path).fingerprint:
        raise ConfigError(f"teacher {cfg.teacher} was trained with the tokenizer {taught_with or 'the default'}, "
                          f"this run uses {cfg.tokenizer_path or 'the default'}: distillation needs the teacher's "
                          "tokenizer")
    if teacher.config.vocab_size != student.config.vocab_size:
        raise ConfigError(f"teacher {cfg.teacher} has vocab_size {teacher.config.vocab_size}, the student "
                          f"{student.config.vocab_size}: set vocab_size={teacher.config.vocab_size}")
    return teacher.eval().requires_grad_(False)


def validation_metrics(model, teacher, val_loader, cfg, run) -> dict[str, float]:
    """val_loss: the student's cross-entropy (comparable with a student trained without a teacher, as
    losses.lm_totals defines it), val_kl: its KL from the teacher at temperature T, both per loss-carrying token,
    on the first eval_steps batches."""
    def batch_sums(batch):
        X, Y, loss_mask, _, positions, _, _ = batch
        logits, ce = model(X, Y, reduction="none", positions=positions)
        _, kl_sum, ce_sum = distill_loss(logits, teacher(X, Y, positions=positions)[0], ce, loss_mask, cfg.alpha,
                                         cfg.temperature)
        return {"loss": ce_sum, "kl": kl_sum, "tokens": loss_mask.sum()}

    model.eval()
    with run.autocast():
        sums = evaluate(batch_sums, val_loader.batches(cfg.eval_steps), run)
    model.train()
    tokens = max(sums.pop("tokens"), 1)
    return {f"val_{k}": v / tokens for k, v in sums.items()} | {"val_ppl": perplexity(sums["loss"] / tokens)}


def main(argv: list[str]):
    cfg, model_cfg = load_config(argv, DistillConfig, ModelConfig)  # the student's keys are ModelConfig's (model.py)
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    model = student_model(cfg, model_cfg, run)
    model_cfg = model.config
    teacher = load_teacher(cfg, model, run)
    print_run(cfg, model_cfg, run)
    print0(f"student {model.num_params():,} parameters, teacher {teacher.num_params():,}")
    resume_from = checkpoint_to_resume(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer_path)
    # pretraining windows or SFT conversations of the model's max_seq_len, as those stages read them
    make_loaders = pretrain_loaders if cfg.data_kind == "pretrain" else sft_loaders
    loader, val_loader = make_loaders(cfg, tokenizer, model_cfg.max_seq_len, run)
    max_steps, warmup_steps, _ = schedule_length(cfg, loader, val_loader, run)

    best = EarlyStopping()  # no patience: it only tracks the best validation loss
    # the checkpoints' stage is the data's: it says what the student does (continue text or chat) to sample.py
    training = prepare_training(cfg, cfg.data_kind, run, model, loader, best, resume_from, max_steps)
    model, raw_model, optimizer, scaler, guard, checkpoints, step, log, stop, profiler, timer = training
    if step == 0:  # the student before training, for the record
        with timer.paused():
            log.write({"step": 0, **validation_metrics(raw_model, teacher, val_loader, cfg, run)})

    while step < max_steps:
        timer.begin(step)  # an out-of-memory error names the step
        set_lr(optimizer, lr := get_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=warmup_steps, max_steps=max_steps))
        # as in SFT: the step's loss is a mean over all its loss-carrying tokens on all ranks, counted first
        with timer.phase("data"):
            batches = [loader.next_batch() for _ in range(cfg.accum_steps)]
            n_tokens = all_reduce_sum(sum(batch.loss_mask.sum() for batch in batches), run).clamp(min=1)
        sums = torch.zeros(3, device=run.device)  # loss, KL, cross-entropy
        aux_sum = torch.zeros((), device=run.device)
        for micro_step, (X, Y, loss_mask, _, positions, _, real_tokens) in enumerate(batches):
            # the student's training FLOPs and the teacher's forward (a third of training's), counted before the
            # work: an error names this batch
            timer.count(X, raw_model.flops_per_token(X.size(1)) + teacher.flops_per_token(X.size(1)) / 3, real_tokens)
            with run.no_sync(model, last_micro_step=micro_step == cfg.accum_steps - 1):
                with timer.phase("forward"), run.autocast():
                    with torch.no_grad():
                        teacher_logits, _ = teacher(X, Y, positions=positions)  # (B, T, V) float32
                    logits, ce = model(X, Y, reduction="none", positions=positions)  # (B, T, V), (B, T)
                    loss_sum, kl_sum, ce_sum = distill_loss(logits, teacher_logits, ce, loss_mask, cfg.alpha,
                                                            cfg.temperature)
                    loss = loss_sum * run.world_size / n_tokens  # x world_size: DDP averages the ranks' gradients
                    aux = aux_loss(model)  # the student's experts' load balancing (0 for a dense model)
                with timer.phase("backward"):
                    scaler.scale(loss + aux / cfg.accum_steps).backward()
            aux_sum += aux.detach()
            sums += torch.stack([loss.detach(), kl_sum * run.world_size / n_tokens, ce_sum * run.world_size / n_tokens])
        with timer.phase("optimizer"):
            # all ranks step, skip and stop alike
            loss, kl, ce, stop_votes = all_reduce_mean(torch.cat([sums, stop.vote().view(1)]), run)
            scaler.unscale_(optimizer)  # float16: clip the true gradients, not the scaled ones
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
            log.grad_flow(step + 1, raw_model, cfg.grad_log_interval)
            guard.check(loss, grad_norm, optimizer)  # a NaN/Inf loss or gradient: this step is skipped
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        step += 1
        if profiler:
            profiler.step()

        stopping = stop.requested(stop_votes, step)  # Ctrl-C / SIGTERM on any rank: all ranks save and stop
        if step % cfg.log_interval == 0 or step == max_steps:  # the loop's only host syncs (.item())
            skipped = guard.report(step, loss.item(), grad_norm.item())  # names skipped steps; too many stop the run
            log.write({"step": step, "loss": loss.item(), "kl": kl.item(), "ce": ce.item(), "ppl": perplexity(ce.item()),
                       "lr": lr, "grad_norm": grad_norm.item(), "skipped_steps": skipped, **timer.read(step),
                       **experts_row(raw_model, aux_sum / cfg.accum_steps, run)})
        if step % cfg.eval_interval == 0 or step == max_steps:
            with timer.paused():
                val_metrics = validation_metrics(raw_model, teacher, val_loader, cfg, run)
                log.write({"step": step, **val_metrics})
                if best.update(val_metrics["val_loss"]):
                    checkpoints.save("best.pt", step)
        if step % cfg.save_interval == 0 or step == max_steps or stopping:
            with timer.paused():
                checkpoints.save(f"step_{step:07d}.pt", step)
        if stopping:
            break
    stop.restore()
    print0(f"done: step {step}, best val_loss {best.best:.4f}, checkpoints in {cfg.out_dir}")
    teardown(run)


if __name__ == "__main__":
    cli(main)
