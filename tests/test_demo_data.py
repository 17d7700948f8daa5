"""The demo's pretraining text: the share of sum paragraphs that add numbers to themselves, and its bounds."""
import random
import re

import pytest

import demo_data
import prepare_demo
from errors import UserError


def operand_pairs(paragraph):
    return [tuple(map(int, re.match(r"\D*(\d+)\D+(\d+)", s).groups())) for s in paragraph]


def share_of_doubles(doubles, n=2000):
    rng = random.Random(0)
    paragraphs = [operand_pairs(demo_data.sum_paragraph(rng, rng.choice(["en", "zh"]), 20, doubles)) for _ in range(n)]
    return sum(all(a == b for a, b in p) for p in paragraphs) / n


def test_a_share_of_the_sum_paragraphs_adds_each_number_to_itself():
    assert share_of_doubles(1.0) == 1.0
    assert share_of_doubles(0.0) < 0.01  # only by chance: 2-5 random pairs all equal
    assert 0.17 < share_of_doubles(0.2) < 0.23  # the default, within 3 standard deviations of 2000 draws
    rng = random.Random(1)
    numbers = [a for a, _ in operand_pairs(demo_data.sum_paragraph(rng, "en", 20, 1.0))]
    assert len(set(numbers)) == len(numbers)  # distinct numbers: a paragraph is not one fact repeated


@pytest.mark.parametrize("value", ["-0.1", "1.5", "nan"])
def test_a_share_outside_0_1_is_a_config_error(value, tmp_path):
    with pytest.raises(UserError, match="sum_doubles"):
        prepare_demo.main([f"--out_dir={tmp_path}", f"--sum_doubles={value}"])
    assert list(tmp_path.iterdir()) == []  # nothing written
