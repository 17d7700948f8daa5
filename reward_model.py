"""
A reward model: the transformer with a scalar head on each sequence's last token, trained by train_reward.py to
score the chosen answer of a preference pair above the rejected one (Bradley-Terry):

    loss = -log sigmoid(r_chosen - r_rejected)

    rm, tokenizer = load_reward_model("out/reward/best.pt", device)
    rewards = score(rm, tokenizer, [[{"role": "user", "content": "Where is Kenya?"}]], ["Kenya is in Africa."])

An answer is scored as SFT and DPO render it: prompt and answer in the tokenizer's chat template, up to the answer's
end-of-turn token (</s> or <|im_end|>), whose final hidden state the head reads.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from chat import encode_chat
from checkpoint import checkpoint_tokenizer, load_checkpoint, load_model_state
from errors import CheckpointError
from model import ModelConfig, Transformer


class RewardModel(nn.Module):
    """A Transformer body (its LM head unused) and score_head, read at each row's last real token."""

    def __init__(self, body: Transformer):
        super().__init__()
        self.body, self.config = body, body.config
        self.score_head = nn.Linear(body.config.dim, 1, bias=False, device=body.tok_embeddings.weight.device)
        # zero: every reward starts at 0 (the loss at ln 2), and no random direction pulls on SFT's features
        nn.init.zeros_(self.score_head.weight)

    def forward(self, idx: torch.Tensor, ends: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Ids (B, T) -> the rewards (n,) in float32 of the n sequences whose last tokens are at ends (n,) in
        idx.flatten(). positions: rows packed with several sequences (Transformer.hidden_states)."""
        h = self.body.hidden_states(idx, positions=positions)  # (B, T, dim), float32: the residual stream's
        last = h.flatten(0, 1)[ends]  # (n, dim)
        # a dot product in float32: under autocast a Linear would round the reward to bfloat16
        return (last.float() * self.score_head.weight.float()).sum(dim=-1)

    def flops_per_token(self, seq_len: int) -> float:
        """The body's training FLOPs per token, less its LM head, which a reward model never runs."""
        return self.body.flops_per_token(seq_len) - 3 * 2 * self.body.output.weight.numel()


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor):
    """(mean loss over the pairs, metrics) from the rewards of each pair's chosen and rejected answer, (n,) each."""
    margin = chosen - rejected
    loss = -F.logsigmoid(margin).mean()  # log(sigmoid(x)) computed stably for large |x|
    metrics = {"pair_acc": (margin > 0).float().mean(), "reward_margin": margin.mean(),
               "chosen_reward": chosen.mean(), "rejected_reward": rejected.mean()}
    return loss, {k: v.detach() for k, v in metrics.items()}


def batch_scores(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) rewards, (pairs,) each, of a batch of preference pairs, each sequence read at its answer's
    last token. data.DPOData's rows (the chosen, then the rejected; X, Y right-padded, loss_mask 1 on the answers):
    each row whole again, read at its last real token. PackedDPOData's whole pieces: read at each piece's end."""
    X, Y, loss_mask, _, positions, ends, _ = batch
    if positions is not None:
        return model(X, ends, positions).view(-1, 2).unbind(dim=1)  # each pair's chosen, then its rejected
    ids = torch.cat([X[:, :1], Y], dim=1)  # (n, T + 1): a row's first id, then all the others
    last = (torch.arange(1, ids.size(1), device=ids.device) * (loss_mask > 0)).amax(dim=1)  # Y[:, j] is ids[:, j + 1]
    return model(ids, torch.arange(ids.size(0), device=ids.device) * ids.size(1) + last).chunk(2)


# -----------------------------------------------------------------------------
# loading one, and scoring answers with it

def reward_model_from_checkpoint(path: str, device="cpu") -> tuple[RewardModel, dict]:
    """(the reward model of a train_reward.py checkpoint, its weights loaded strictly; the checkpoint itself)."""
    state = load_checkpoint(path)
    if state.get("stage") != "reward":
        raise CheckpointError(f"{path} is not a reward model but a {state.get('stage', 'stage-less')} checkpoint: "
                              f"train one with train_reward.py")
    model = RewardModel(Transformer(ModelConfig(**state["model_config"])))
    load_model_state(model, state["model"], path)
    return model.to(device), state


def load_reward_model(path: str, device="cpu"):
    """(eval-mode reward model, the tokenizer it was trained with) for scoring."""
    model, state = reward_model_from_checkpoint(path, device)
    return model.eval(), checkpoint_tokenizer(state)


def answer_ids(tokenizer, messages: list[dict], completion: str) -> list[int]:
    """The ids a reward model scores: messages (ending with the user's turn) and the completion as the assistant's
    answer, rendered as SFT renders it, cut after the answer's end-of-turn token as DPO's pairs are."""
    ids, mask = encode_chat(tokenizer, messages + [{"role": "assistant", "content": completion}])
    return ids[: len(mask) - mask[::-1].index(1)]


@torch.no_grad()
def score_ids(model: RewardModel, rows: list[list[int]], pad_id: int, batch_size: int = 16) -> list[float]:
    """The reward of each row of ids, batch_size rows per forward pass. A row longer than the model's context loses
    its beginning: its end is what the head reads."""
    T, device = model.config.max_seq_len, next(model.parameters()).device
    rewards = []
    for i in range(0, len(rows), batch_size):
        batch = [row[-T:] for row in rows[i : i + batch_size]]
        ids = torch.full((len(batch), max(map(len, batch))), pad_id, dtype=torch.long)  # (B, longest row)
        for r, row in enumerate(batch):
            ids[r, : len(row)] = torch.as_tensor(row)
        ends = torch.tensor([r * ids.size(1) + len(row) - 1 for r, row in enumerate(batch)])  # each row's last id
        rewards += model(ids.to(device), ends.to(device)).tolist()
    return rewards


def score(model: RewardModel, tokenizer, messages_list: list[list[dict]], completions: list[str],
          batch_size: int = 16) -> list[float]:
    """The reward of each completion after its prompt (a list of chat messages ending with the user's turn)."""
    if len(messages_list) != len(completions):
        raise ValueError(f"{len(messages_list)} prompts but {len(completions)} completions")
    rows = [answer_ids(tokenizer, messages, completion) for messages, completion in zip(messages_list, completions)]
    return score_ids(model, rows, tokenizer.pad_id, batch_size)
