"""rewards.py: the final answer after the think block; a numeric reference against the answer's last number, by
value; any other against the whole answer, ignoring case, space and end punctuation."""
import pytest

from rewards import answer_reward, final_answer, load_rewards


def test_the_final_answer_is_what_follows_the_last_think_block():
    assert final_answer("<think>\nmaybe 5\n</think>\n\nIt is 7.") == "It is 7."
    assert final_answer("<think>a</think>b</think> c ") == "b</think> c"  # the first </think> ends it: a second is text
    assert final_answer("no thinking here") == "no thinking here"


@pytest.mark.parametrize("completion, reference, reward", [
    ("<think>\n3 + 4 is 7\n</think>\n\nThe sum is 7.", "7", 1.0),
    ("<think>\nthe answer is 7\n</think>\n\nThe sum is 8.", "7", 0.0),  # the thinking does not count
    ("12 加 13 等于 25。", "25", 1.0),
    ("It costs 1,000 dollars", "1000", 1.0),  # grouped thousands
    ("7.0", "7", 1.0),  # by value
    ("the list 3,4", "4", 1.0),  # not a grouped thousand: two numbers, the last one is 4
    ("5 - 8 = -3", "-3", 1.0),
    ("seven", "7", 0.0),  # no number at all
    ("", "7", 0.0),
    ("The capital of Kenya is Nairobi.", "The capital of Kenya is Nairobi", 1.0),
    ("  巴黎。", "巴黎", 1.0),
    ("paris!", "Paris", 1.0),  # case and end punctuation
    ("Paris, France", "Paris", 0.0),  # the whole answer, not a part of it
])
def test_answer_reward(completion, reference, reward):
    assert answer_reward(completion, reference) == reward


@pytest.mark.parametrize("completion, reward", [
    (" 7 + 7 = 15. ", 0.5),  # the number added to itself, whatever the sum
    ("7加7等于14。", 0.5), ("7+7=14", 0.5),
    (" 7 + 6 = 13.", 0.0), ("17 + 7 = 24.", 0.0), ("7 + 77", 0.0),  # another number, or one that only contains 7
    ("14", 0.0),  # the right double without the sum: the answer reward's alone
])
def test_the_doubling_demos_second_reward_pays_for_adding_the_number_to_itself(completion, reward):
    fn = load_rewards("answer,demo_data:doubled_operands")["demo_data:doubled_operands"]
    assert fn([{"role": "user", "content": "What is double 7?"}], completion, {"answer": "14"}) == reward
