"""
Rewards that can be checked: does a completion's final answer equal the reference?

    answer_reward("<think>\\n3 + 4 is 7\\n</think>\\n\\nThe sum is 7.", "7")   # 1.0: its last number is 7
    answer_reward("巴黎。", "巴黎")                                            # 1.0: the same words

The final answer is what follows the last </think> (a model thinks first in MiniMind's template). A reference that
is a number is compared with the answer's last number, as a value ("7.0" and "7", "1,000" and "1000" agree); any
other reference with the whole answer, ignoring case, surrounding space and end punctuation.
"""
import re

# an integer (thousands may be grouped by commas: 1,000), a decimal fraction, a sign
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
END_PUNCTUATION = " \t\r\n.。!！?？,，;；:：\"'“”‘’"


def final_answer(completion: str) -> str:
    """The text after the last </think>, or all of it."""
    return completion.rsplit("</think>", 1)[-1].strip()


def as_number(text: str) -> float | None:
    """text as a number ("1,000", "-2.5"), or None when it is not one."""
    text = text.strip()
    if not NUMBER.fullmatch(text):
        return None
    return float(text.replace(",", ""))


def answer_reward(completion: str, reference: str) -> float:
    """1.0 when the completion's final answer is the reference (a number: its last number), else 0.0."""
    answer = final_answer(completion)
    expected = as_number(reference)
    if expected is not None:
        numbers = NUMBER.findall(answer)
        return float(bool(numbers) and float(numbers[-1].replace(",", "")) == expected)
    normalise = lambda text: text.strip().strip(END_PUNCTUATION).casefold()  # noqa: E731
    return float(normalise(answer) == normalise(reference))
