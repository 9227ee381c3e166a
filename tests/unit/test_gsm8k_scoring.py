"""The demo agent's scoring: final-answer extraction over many formats, correctness, and the reward rule."""

import pytest

from integrations.gsm8k.scoring import extract_answer, is_correct, is_formatted, normalize_number, reward


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#### 72", "72"),
        ("####72", "72"),
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("#### 1,234,567", "1234567"),
        ("#### $18", "18"),
        ("#### -3", "-3"),
        ("#### 5.00", "5"),
        ("#### 2.50", "2.5"),
        ("#### 72.", "72"),
        ("#### 4\nQuestion: Sam has 9 eggs ...\n#### 9", "4"),  # the first #### is this problem's answer
        ("3 + 4 = 7, so 7 + 1 = 8.\n#### 8 apples", "8"),
        ("The answer is 42.", "42"),
        ("the answer is: $1,000.", "1000"),
        ("The final answer is -7", "-7"),
        ("The answer is 5. Then I double-check: 5 + 0 = 5. So the answer is 6", "6"),  # the last statement
        ("The answer is 3, I think; #### 4", "4"),  # #### wins over "The answer is"
        ("She has 3 apples and buys 2, so 5 in total.", "5"),  # the last number
        ("It costs $12.50 in all.", "12.5"),
        ("Between 10-3 and more", "3"),  # a minus glued to a number after a digit is subtraction
        ("I owe -$4", "-4"),
        ("Version x2 has 3.5 and 3.0", "3"),  # "x2" is no number; 3.0 equals 3
        ("no numbers here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1,234", "1234"), ("$5.00", "5"), ("2.50", "2.5"), ("-3", "-3"), ("0.0", "0"), ("7.", "7"),
     ("abc", None), ("", None), ("nan", None), ("inf", None)],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    ("predicted", "gold", "expected"),
    [("72", "72", True), ("72", 72, True), ("1000", "1,000", True), ("5", "5.0", True),
     ("2.5", "2.50", True), ("-3", "-3", True), ("73", "72", False), ("-72", "72", False),
     (None, "72", False), ("72", "not a number", False)],
)
def test_is_correct(predicted, gold, expected):
    assert is_correct(predicted, gold) is expected


@pytest.mark.parametrize(
    ("text", "gold", "expected"),
    [
        ("2 + 3 = 5\n#### 5", "5", 1.1),  # right, in the #### form: the most there is
        ("#### 5\n#### 5", "5", 1.1),  # the bonus counts once
        ("So the answer is 5.", "5", 1.0),  # right, not in the #### form
        ("#### 6", "5", 0.1),  # wrong but formatted: the bonus alone
        ("I think 6.", "5", 0.0),
        ("", "5", 0.0),
        ("#### 1,000", 1000, 1.1),
    ],
)
def test_reward_values(text, gold, expected):
    assert reward(text, gold) == pytest.approx(expected)


def test_reward_bonus_is_a_parameter_and_caps_the_maximum():
    assert reward("#### 5", "5", format_bonus=0.0) == 1.0
    assert reward("#### 5", "5", format_bonus=0.25) == pytest.approx(1.25)
    assert reward("#### 4", "5", format_bonus=0.25) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="format_bonus"):
        reward("#### 5", "5", format_bonus=-0.1)


def test_is_formatted_needs_a_number_after_the_hashes():
    assert is_formatted("so\n#### 12")
    assert not is_formatted("#### twelve")
    assert not is_formatted("The answer is 12")
