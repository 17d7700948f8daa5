"""Validation records are never trained on: the split is the last records (across several files too) or a file of
its own, disjoint by content from training, for every kind of data."""
import json
import re

import pytest

from data import PretrainData
from token_cache import load_split

ID = re.compile(r"record-(\d{4})(?!\d)")  # digits are single tokens: a window that cuts an id in half shows no match


def record(kind: str, i: int) -> dict:
    """A record that names its id, record-NNNN, where the split is read: the text, the conversation, the prompt."""
    name = f"record-{i:04d}"
    if kind == "pretrain":
        return {"text": f"{name} opens this document, and {name} closes it."}
    if kind == "sft":
        return {"conversations": [{"role": "user", "content": f"Which record is this? {name}"},
                                  {"role": "assistant", "content": f"It is {name}."}]}
    return {"prompt": f"Name {name}, please.", "chosen": f"{name}.", "rejected": "No."}


# what each training script passes for its kind (train_sft.py, train_dpo.py)
OPTIONS = {"pretrain": {}, "sft": {"max_len": 65}, "dpo": {"max_prompt_length": 64, "max_completion_length": 64}}


def write_records(path, kind: str, ids) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for i in ids:
            f.write(json.dumps(record(kind, i)) + "\n")
    return str(path)


def ids_of(records, tok) -> list[int]:
    """The id each record carries, read back from its tokens (the text, the conversation, the DPO prompt)."""
    out = []
    for i in range(len(records)):
        found = set(ID.findall(tok.decode(records[i][0].tolist())))
        assert len(found) == 1, f"record {i} holds ids {found}"
        out.append(int(found.pop()))
    return out


def ids_in_windows(data, tok) -> set[int]:
    """Every id that appears whole in a window the loader can hand out."""
    return {int(m) for w in range(len(data)) for m in ID.findall(tok.decode(data[w][0][0].tolist()))}


@pytest.mark.parametrize("kind", ["pretrain", "sft", "dpo"])
@pytest.mark.parametrize("n, val_fraction, n_val", [(40, 0.2, 8), (37, 0.1, 4)])  # 3.7 rounds to 4
def test_validation_is_the_last_records_and_disjoint_from_training(kind, n, val_fraction, n_val, tok, tmp_path):
    path = write_records(tmp_path / f"{kind}.jsonl", kind, range(n))
    train, val = load_split(path, None, val_fraction, tok, kind, verbose=False, **OPTIONS[kind])
    train_ids, val_ids = ids_of(train, tok), ids_of(val, tok)
    assert not set(train_ids) & set(val_ids)
    assert train_ids == list(range(n - n_val)) and val_ids == list(range(n - n_val, n))  # in file order, all of them


@pytest.mark.parametrize("kind", ["pretrain", "sft", "dpo"])
def test_validation_is_the_last_records_across_files(kind, tok, tmp_path):
    options = {"pretrain": {}, "sft": {"max_len": 65}, "dpo": {"max_prompt_length": 64, "max_completion_length": 64}}
    for name, ids in (("a", range(0, 10)), ("b", range(10, 20)), ("c", range(20, 25))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(record(kind, i)) + "\n" for i in ids))
    # 25 records, 0.32 of them = 8: all 5 of c.jsonl and the last 3 of b.jsonl
    train, val = load_split(str(tmp_path / "*.jsonl"), None, 0.32, tok, kind, verbose=False, **options[kind])
    assert ids_of(train, tok) == list(range(17)) and ids_of(val, tok) == list(range(17, 25))
    if kind == "pretrain":
        seen = [{int(m) for w in range(len(d)) for m in ID.findall(tok.decode(d[w][0][0].tolist()))}
                for d in (PretrainData(train, 32), PretrainData(val, 32))]
        assert seen[0] <= set(range(17)) and seen[1] <= set(range(17, 25))


def test_pretraining_windows_of_training_and_validation_share_no_record(tok, tmp_path):
    n, n_val, max_seq_len = 40, 8, 32
    path = write_records(tmp_path / "pretrain.jsonl", "pretrain", range(n))
    train, val = load_split(path, None, 0.2, tok, "pretrain", verbose=False)
    train_seen = ids_in_windows(PretrainData(train, max_seq_len), tok)
    val_seen = ids_in_windows(PretrainData(val, max_seq_len), tok)
    assert not train_seen & val_seen
    assert train_seen <= set(range(n - n_val)) and val_seen <= set(range(n - n_val, n))
    # a record (26 tokens, its id twice, 12 tokens apart) shows an id whole in some window of 33 tokens, unless
    # the tail that fills no window (< 32 tokens) holds it: at most the last two records of each side are unseen
    assert train_seen >= set(range(n - n_val - 2)) and val_seen >= set(range(n - n_val, n - 2))


@pytest.mark.parametrize("kind", ["pretrain", "sft", "dpo"])
def test_a_validation_file_is_the_validation_set_and_training_keeps_every_record(kind, tok, tmp_path):
    path = write_records(tmp_path / f"{kind}.jsonl", kind, range(20))
    val_path = write_records(tmp_path / f"{kind}_val.jsonl", kind, range(1000, 1005))
    train, val = load_split(path, val_path, 0.2, tok, kind, verbose=False, **OPTIONS[kind])
    assert ids_of(train, tok) == list(range(20))
    assert ids_of(val, tok) == list(range(1000, 1005))


def test_the_held_out_share_is_at_least_one_item_and_never_all():
    from errors import DataError
    from token_cache import held_out
    assert (held_out(10, 0.05, "d.jsonl", "prompts"), held_out(100, 0.05, "d.jsonl", "prompts")) == (1, 5)
    with pytest.raises(DataError, match="d.jsonl: 1 prompts are too few to hold out 1 for validation"):
        held_out(1, 0.05, "d.jsonl", "prompts")
