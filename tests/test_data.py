"""data.py: packed pretraining windows, padded rows, one row per conversation, and the Loader: ranks share out the
global batch, a resumed loader goes on where it stopped, evaluation batches cover every item once."""
import numpy as np
import torch

from conftest import CONVERSATION, write_jsonl
from data import Loader, PretrainData, SFTData, pad_rows
from token_cache import tokenize_file


def test_packing_brackets_documents_and_shifts_targets(tok, tmp_path):
    docs = [f"document {i}: " + "word " * (i % 7) for i in range(40)]
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": d} for d in docs])
    records = tokenize_file(path, tok, "pretrain", verbose=False)
    stream = np.concatenate([records[i][0] for i in range(len(records))])
    expected = [t for d in docs for t in [tok.bos_id] + tok.encode(d) + [tok.eos_id]]
    assert stream.tolist() == expected
    data = PretrainData(records, max_seq_len=16)
    assert len(data) == (len(expected) - 1) // 16
    X, Y, M = pad_rows([data[i][0] for i in range(len(data))], tok.pad_id)
    assert X.shape == Y.shape == M.shape == (len(data), 16)
    assert torch.equal(X[:, 1:], Y[:, :-1]) and torch.equal(X[1:, 0], Y[:-1, -1])  # windows share one token
    assert torch.equal(X.flatten(), torch.tensor(expected[: len(data) * 16]))
    assert M.min() == 1


def test_loader_ranks_partition_the_global_batch_and_resume_exactly(tok, tmp_path):
    class Items:
        def __len__(self):
            return 37

        def __getitem__(self, i):
            return ((np.array([i, i]), None),)

    def firsts(loader, n):
        return [loader.next_batch()[0][:, 0].tolist() for _ in range(n)]

    single = firsts(Loader(Items(), 8, pad_id=0, seed=3), 9)  # 4 batches per epoch: crosses two epochs
    ranks = [firsts(Loader(Items(), 4, pad_id=0, seed=3, rank=r, world_size=2), 9) for r in range(2)]
    for b in range(9):
        assert sorted(ranks[0][b] + ranks[1][b]) == sorted(single[b])
        assert not set(ranks[0][b]) & set(ranks[1][b])
    assert len(set(sum(single[:4], []))) == 32 and single[4:8] != single[:4]  # each epoch: distinct items, new order
    loader = Loader(Items(), 8, pad_id=0, seed=3)
    firsts(loader, 6)
    resumed = Loader(Items(), 8, pad_id=0, seed=3)
    resumed.load_state_dict(loader.state_dict())
    assert firsts(resumed, 3) == single[6:9]


def test_pad_rows_pads_to_the_longest_row_with_mask_zero():
    rows = [(np.array([5, 6, 7]), np.array([0, 1, 1])), (np.array([8, 9, 10, 11, 12]), np.array([0, 0, 1, 1, 1]))]
    X, Y, M = pad_rows(rows, pad_id=0)
    assert X.tolist() == [[5, 6, 0, 0], [8, 9, 10, 11]]
    assert Y.tolist() == [[6, 7, 0, 0], [9, 10, 11, 12]]
    assert M.tolist() == [[1, 1, 0, 0], [0, 1, 1, 1]]


def test_sft_data_items_are_single_rows(tok, tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": CONVERSATION[1:3]}] * 3)
    data = SFTData(tokenize_file(path, tok, "sft", max_len=64, verbose=False))
    assert len(data) == 3 and len(data[0]) == 1


def test_evaluation_batches_cover_every_item_once_across_ranks_and_keep_the_position():
    class Items:
        def __len__(self):
            return 11

        def __getitem__(self, i):
            return ((np.array([i, i]), None),)

    seen = []
    for rank in range(2):
        loader = Loader(Items(), 4, pad_id=0, rank=rank, world_size=2)
        loader.next_batch()
        seen += [x for X, *_ in loader.batches(limit=100) for x in X[:, 0].tolist()]
        assert loader.state_dict() == {"epoch": 0, "pos": 1, "items": 11, "batch": 8}
    assert sorted(seen) == list(range(11))
    assert sum(len(X) for X, *_ in Loader(Items(), 4, pad_id=0).batches(limit=2)) == 8
