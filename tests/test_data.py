import ast
import json
import os

import numpy as np
import pytest
import torch

from chat import encode_chat, show_mask
from data import DPOData, Loader, PretrainData, SFTData, pad_rows
from errors import BadRecord
from token_cache import tokenize_file
from tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return str(path)


def runs(ids, mask):
    """Split a sequence into maximal runs of equal mask value: [(mask value, ids)]."""
    out = []
    for t, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "法国在哪里？"},
    {"role": "assistant", "content": "法国位于欧洲。"},
]


def test_golden_chat_template_and_mask(tok):
    ids, mask = encode_chat(tok, CONVERSATION)
    assert tok.decode(ids) == (
        "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nWhat is the capital of France? [/INST]"
        " The capital of France is Paris. </s>"
        "<s>[INST] 法国在哪里？ [/INST] 法国位于欧洲。 </s>")
    # loss exactly on each assistant answer and its </s>; everything else (<s>, [INST], system, user, [/INST]) off
    learned = [tok.decode(r) for m, r in runs(ids, mask) if m == 1]
    assert learned == [" The capital of France is Paris. </s>", " 法国位于欧洲。 </s>"]
    assert [m for t, m in zip(ids, mask) if t == tok.eos_id] == [1, 1]
    specials = {tok.bos_id, *[t for name in ("[INST]", "[/INST]", "<<SYS>>", "<</SYS>>") for t in tok.chat_tokens[name]]}
    assert all(m == 0 for t, m in zip(ids, mask) if t in specials)


def test_chat_special_tokens_are_single_ids(tok):
    ids, _ = encode_chat(tok, CONVERSATION)
    for name in ("[INST]", "[/INST]", "<<SYS>>", "<</SYS>>"):
        assert len(tok.chat_tokens[name]) == 1
    assert ids.count(tok.bos_id) == 2 and ids.count(tok.chat_tokens["<<SYS>>"][0]) == 1


def test_a_generation_prompt_ends_at_inst_close(tok):
    ids, mask = encode_chat(tok, CONVERSATION[:4])
    assert ids[-1] == tok.chat_tokens["[/INST]"][0]
    full, _ = encode_chat(tok, CONVERSATION)
    assert full[: len(ids)] == ids  # the prompt the chat CLI feeds is exactly what training saw


def test_too_long_drops_earliest_turns_and_keeps_the_system_prompt(tok):
    full, _ = encode_chat(tok, CONVERSATION)
    last_turn, _ = encode_chat(tok, [CONVERSATION[0]] + CONVERSATION[3:])
    ids, mask = encode_chat(tok, CONVERSATION, max_len=len(full) - 1)
    assert ids == last_turn and tok.decode(ids).startswith("<s>[INST] <<SYS>>\nYou are terse.")
    # a single turn that cannot fit is cut at the end; its answer loses the closing </s>
    one_turn, one_mask = encode_chat(tok, CONVERSATION[:3])
    ids, mask = encode_chat(tok, CONVERSATION[:3], max_len=len(one_turn) - 3)
    assert (ids, mask) == (one_turn[:-3], one_mask[:-3]) and ids[-1] != tok.eos_id and mask[-1] == 1


@pytest.mark.parametrize("messages, reason", [
    ([{"role": "assistant", "content": "hi"}], "alternate"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "alternate"),
    ([{"role": "user", "content": ""}, {"role": "assistant", "content": "b"}], "non-empty"),
    ([{"role": "robot", "content": "a"}], "unknown role"),
    ([], "non-empty list"),
])
def test_bad_conversations_are_rejected(tok, messages, reason):
    with pytest.raises(BadRecord, match=reason):
        encode_chat(tok, messages)


def test_show_mask_marks_every_token(tok):
    ids, mask = encode_chat(tok, CONVERSATION[1:3])
    assert 0 < sum(mask) < len(mask)
    lines = show_mask(tok, ids, mask).splitlines()
    assert len(lines) == len(ids)
    for i, line in enumerate(lines):  # "position id mark 'text'": the text is the repr of the token's decoding
        position, token, mark, text = line.split(maxsplit=3)
        assert (int(position), int(token), mark) == (i, ids[i], "✓" if mask[i] else "✗"), line
        assert ast.literal_eval(text) == tok.decode([ids[i]]), line
    assert lines[0].split() == ["0", str(tok.bos_id), "✗", "'<s>'"]
    assert lines[-1].split() == [str(len(ids) - 1), str(tok.eos_id), "✓", "'</s>'"]


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


def test_txt_files_are_split_into_documents_at_blank_lines(tok, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("first doc\nline two\n\n\nsecond doc\n", encoding="utf-8")
    records = tokenize_file(str(path), tok, "pretrain", verbose=False)
    assert [tok.decode(records[i][0]) for i in range(len(records))] == ["<s>first doc\nline two</s>", "<s>second doc</s>"]


@pytest.mark.parametrize("line, reason", [
    ('{"text": "ok"', "malformed JSON"),
    ('{"txt": "ok"}', "missing field 'text'"),
    ('{"text": 5}', "'text' must be a string"),
    ('["text"]', "expected a JSON object"),
])
def test_bad_pretrain_lines_name_file_and_line(tok, tmp_path, line, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, {"text": "also fine"}, line])
    with pytest.raises(BadRecord, match=rf"bad\.jsonl:3: .*{reason}"):
        tokenize_file(path, tok, "pretrain", verbose=False)


def test_bad_sft_lines_fail_with_file_line_or_are_skipped_and_counted(tok, tmp_path, capsys):
    good = {"conversations": CONVERSATION[1:3]}
    rows = [good, {"conversations": CONVERSATION[1:2]}, good, {"conversations": [{"role": "user", "content": ""}]}]
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    with pytest.raises(BadRecord, match=r"sft\.jsonl:2: "):
        tokenize_file(path, tok, "sft", max_len=64, verbose=False)
    assert len(tokenize_file(path, tok, "sft", max_len=64, skip_bad=True)) == 2


def test_skipped_lines_are_counted_by_reason(tok, tmp_path, capsys):
    good = {"conversations": CONVERSATION[1:3]}
    rows = [good, {"conversations": CONVERSATION[1:2]}, good, {"conversations": CONVERSATION[1:2]}]
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    records = tokenize_file(path, tok, "sft", max_len=64, skip_bad=True)
    assert len(records) == 2
    assert "2 x skipped: the last message must be the assistant's" in capsys.readouterr().err


def test_sft_records_carry_the_chat_mask_fresh_and_from_the_cache(tok, tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"conversations": CONVERSATION[1:3]},
                                                {"conversations": CONVERSATION[1:], "system": "You are terse."}])
    for _ in range(2):  # built, then read back from the cache
        records = tokenize_file(path, tok, "sft", max_len=512, verbose=False)
        assert [(ids.tolist(), mask.tolist()) for ids, mask in (records[0], records[1])] == [
            encode_chat(tok, CONVERSATION[1:3]), encode_chat(tok, CONVERSATION)]


def test_both_dpo_formats_load_and_mask_only_the_answers(tok, tmp_path):
    user = {"role": "user", "content": "What is 2 + 3?"}
    rows = [{"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5.", "rejected": "2 + 3 = 6."},
            {"chosen": [user, {"role": "assistant", "content": "2 + 3 = 5."}],
             "rejected": [user, {"role": "assistant", "content": "2 + 3 = 6."}]}]
    data = DPOData(tokenize_file(write_jsonl(tmp_path / "d.jsonl", rows), tok, "dpo", verbose=False))
    assert len(data) == 2
    for i in range(2):
        (chosen, cmask), (rejected, rmask) = data[i]
        assert tok.decode(chosen) == "<s>[INST] What is 2 + 3? [/INST] 2 + 3 = 5. </s>"
        assert tok.decode(chosen[cmask == 1]) == " 2 + 3 = 5. </s>"
        assert tok.decode(rejected[rmask == 1]) == " 2 + 3 = 6. </s>"
    assert [a.tolist() for a in data[0][0]] == [a.tolist() for a in data[1][0]]


@pytest.mark.parametrize("row", [
    {"prompt": "q", "chosen": "", "rejected": "b"},
    {"prompt": "q", "chosen": "a", "rejected": "  "},
    {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}],
     "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]},
])
def test_an_empty_dpo_answer_is_rejected_with_file_line(tok, tmp_path, row):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(BadRecord, match=r"d\.jsonl:2: .*(answer|content)"):
        tokenize_file(path, tok, "dpo", verbose=False)


def test_dpo_truncation_cuts_prompt_left_and_completion_right(tok, tmp_path):
    row = {"prompt": "a long question " * 10, "chosen": "a long answer " * 10, "rejected": "no"}
    records = tokenize_file(write_jsonl(tmp_path / "d.jsonl", [row]), tok, "dpo", max_prompt_length=8,
                            max_completion_length=5, verbose=False)
    prompt, chosen, rejected = records[0]
    full_prompt, _ = encode_chat(tok, [{"role": "user", "content": row["prompt"]}])
    assert prompt.tolist() == full_prompt[-8:]
    assert len(chosen) == 5 and rejected[-1] == tok.eos_id


def test_the_cache_is_reused_and_rebuilt_when_source_or_tokenizer_change(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "hello world"}])
    first = tokenize_file(path, tok, "pretrain", verbose=False)
    cache = path + ".pretrain.cache"
    stamp = os.stat(cache).st_mtime_ns
    again = tokenize_file(path, tok, "pretrain", verbose=False)
    assert os.stat(cache).st_mtime_ns == stamp  # reused
    assert len(again) == len(first) and again[0][0].tolist() == first[0][0].tolist()
    write_jsonl(path, [{"text": "hello there world"}])
    second = tokenize_file(path, tok, "pretrain", verbose=False)
    assert second[0][0].tolist() != first[0][0].tolist()
    assert tok.decode(second[0][0]) == "<s>hello there world</s>"

    class OtherTokenizer:  # same ids, another fingerprint: the cache must not be trusted
        def __getattr__(self, name):
            return getattr(tok, name)
        fingerprint = "another"
    stamp = os.stat(cache).st_mtime_ns
    tokenize_file(path, OtherTokenizer(), "pretrain", processes=1, verbose=False)
    assert os.stat(cache).st_mtime_ns != stamp


def test_a_half_written_cache_is_never_trusted(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "hello world"}] * 50)
    tokenize_file(path, tok, "pretrain", verbose=False)
    cache = path + ".pretrain.cache"
    data = open(cache, "rb").read()
    with open(cache, "wb") as f:
        f.write(data[: len(data) // 2])
    records = tokenize_file(path, tok, "pretrain", verbose=False)
    assert len(records) == 50 and os.path.getsize(cache) == len(data)


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
        assert loader.state_dict() == {"epoch": 0, "pos": 1}
    assert sorted(seen) == list(range(11))
    assert sum(len(X) for X, *_ in Loader(Items(), 4, pad_id=0).batches(limit=2)) == 8
