"""
Rewards for reinforcement learning (train_grpo.py): the checkable one -- does a completion's final answer equal the
reference? -- MiniMind's rule rewards, and a user's own functions.

    answer_reward("<think>\\n3 + 4 is 7\\n</think>\\n\\nThe sum is 7.", "7")   # 1.0: its last number is 7
    answer_reward("巴黎。", "巴黎")                                            # 1.0: the same words
    answer_reward("3 × 4 = 12, 5 × 6 = 30", ["12", "30"])                   # 1.0: MiniMind's gt list, each found
    load_rewards("answer,calls")         # train_grpo.py's `reward` key: {name: fn(messages, completion, record)}

The final answer is what follows the think block (reply.py: it ends at the first </think>). A reference that
is a number is compared with the answer's last number, as a value ("7.0" and "7", "1,000" and "1000" agree); any
other reference with the whole answer, ignoring case, surrounding space and end punctuation. A list of references
(MiniMind's agent data's "gt") scores the fraction of them the answer holds: a number among its numbers, other text
anywhere in it, ignoring case.
"""
import re

from chat import json_field
from errors import BadRecord, ConfigError
from reply import THINK_END, split_think, written_calls
from tools import call_problem, check_tools, user_module

# an integer (thousands may be grouped by commas: 1,000), a decimal fraction, a sign
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
END_PUNCTUATION = " \t\r\n.。!！?？,，;；:：\"'“”‘’"


def final_answer(completion: str) -> str:
    """The text after the think block (reply.py's grammar), or all of it, stripped."""
    return split_think(completion)[1].strip()


def as_number(text: str) -> float | None:
    """text as a number ("1,000", "-2.5"), or None when it is not one."""
    text = text.strip()
    if not NUMBER.fullmatch(text):
        return None
    return float(text.replace(",", ""))


def answer_reward(completion: str, reference: str | list) -> float:
    """1.0 when the completion's final answer is the reference (a number: its last number), else 0.0; a list of
    references: the fraction of them found in the answer."""
    answer = final_answer(completion)
    if isinstance(reference, list):
        numbers = {float(n.replace(",", "")) for n in NUMBER.findall(answer)}
        found = [as_number(r) in numbers if as_number(r) is not None else r.strip().casefold() in answer.casefold()
                 for r in map(str, reference)]
        return sum(found) / len(found) if found else 0.0
    expected = as_number(reference)
    if expected is not None:
        numbers = NUMBER.findall(answer)
        return float(bool(numbers) and float(numbers[-1].replace(",", "")) == expected)
    normalise = lambda text: text.strip().strip(END_PUNCTUATION).casefold()  # noqa: E731
    return float(normalise(answer) == normalise(reference))


def reference(record: dict) -> str | list[str] | None:
    """A record's reference answer: its "answer", or MiniMind's "gt"; a number in the JSON as its text; a list
    (MiniMind's agent data) as a list of texts."""
    value = record.get("answer", record.get("gt"))
    if isinstance(value, list):
        return [str(v) for v in value]
    return None if value is None else str(value)


def calls_reward(messages: list[dict], completion: str) -> float:
    """Tool use (train_grpo.py with tools): +0.5 when the turns made calls and every one was well formed and fit
    the tools offered (a known name, its required arguments, their JSON types); -0.5 for each that did not, a
    <tool_call> block that is not JSON among them; 0 without calls. The turns are the assistant messages after
    the last user message (the rollout's, with the calls they made) and the completion (the last turn)."""
    tools = messages[0].get("tools") if messages and messages[0].get("role") == "system" else None
    try:
        functions = check_tools(json_field(tools, "tools"), "the system message's tools") if tools else {}
    except BadRecord as e:
        raise ValueError(str(e)) from None
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    turns = [m | {"tool_calls": json_field(m.get("tool_calls") or [], "tool_calls")} for m in messages[last_user + 1:]]
    calls, malformed = written_calls(turns, completion)
    bad = malformed + sum(call_problem(c, functions) is not None for c in calls)
    if not calls and not bad:
        return 0.0
    return 0.5 if bad == 0 else -0.5 * bad


# -----------------------------------------------------------------------------
# MiniMind's rule rewards (trainer/train_grpo.py), for open-ended prompts without a reference

def length_reward(completion: str) -> float:
    """+0.5 for an answer of 20-800 characters (not counting the think block), else -0.5."""
    return 0.5 if 20 <= len(final_answer(completion)) <= 800 else -0.5


def format_reward(completion: str) -> float:
    """For a completion that thinks: +1 for 20-300 characters of thinking (else -0.5), +0.25 for exactly one
    </think> (else -0.25); 0 for one that does not think."""
    thinking, _ = split_think(completion)
    if thinking is None:
        return 0.0
    return (1.0 if 20 <= len(thinking.strip()) <= 300 else -0.5) + (0.25 if completion.count(THINK_END) == 1 else -0.25)


def repetition_reward(completion: str, n: int = 3, cap: float = 0.5) -> float:
    """Minus the share of the answer's word 3-grams that repeat an earlier one, doubled, at most `cap`."""
    words = re.findall(r"\w+|[^\w\s]", final_answer(completion).lower())
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return -min(cap, (len(grams) - len(set(grams))) * cap * 2 / len(grams)) if grams else 0.0


# -----------------------------------------------------------------------------
# the `reward` key: names of rewards, summed; each is called as fn(messages, completion, record) -> float

BUILT_IN = {
    "answer": lambda messages, completion, record: answer_reward(completion, reference(record)),
    "calls": lambda messages, completion, record: calls_reward(messages, completion),
    "length": lambda messages, completion, record: length_reward(completion),
    "format": lambda messages, completion, record: format_reward(completion),
    "repetition": lambda messages, completion, record: repetition_reward(completion),
}


def load_rewards(spec: str) -> dict:
    """`reward`'s value -> {name: fn(messages, completion, record) -> float}: comma-separated names of the
    built-in rewards (answer, calls, length, format, repetition) or a user's `module:function` / `path.py:function`;
    "none" for no rule reward (a reward model alone)."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if names == ["none"]:
        return {}
    rewards = {}
    for name in names:
        if name in BUILT_IN:
            rewards[name] = BUILT_IN[name]
        elif ":" in name:
            rewards[name] = user_function(name)
        else:
            raise ConfigError(f"config key 'reward' names {name!r}: choose from {', '.join(BUILT_IN)}, none, or a "
                              "module:function of your own")
    if not rewards:
        raise ConfigError("config key 'reward' is empty: name a reward, or none with a reward_model")
    return rewards


def user_function(name: str):
    """'package.module:function' (importable from here) or 'path/to/file.py:function' -> the function."""
    module_name, _, function = name.rpartition(":")
    try:
        module = user_module(module_name)
    except (ImportError, OSError) as e:
        raise ConfigError(f"config key 'reward': cannot import {module_name} ({e})") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ConfigError(f"config key 'reward': {module_name} has no function {function!r}")
    return fn
