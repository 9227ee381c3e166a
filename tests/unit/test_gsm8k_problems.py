"""The demo agent's problems: the offline generator (deterministic, right answers, disjoint splits), GSM8K
JSONL loading, and the fallback from GSM8K to generated problems without touching the network."""

import json
import logging
import sys
import types

import pytest

from integrations.gsm8k import problems as problems_module
from integrations.gsm8k.problems import (
    TEMPLATES,
    Problem,
    generate_problems,
    load_gsm8k,
    load_jsonl,
    load_problems,
    parse_gsm8k_answer,
)
from integrations.gsm8k.scoring import extract_answer

# Each template's answer, recomputed here from the numbers it drew (independently of the generator).
EXPECTED = {
    "add": lambda n: n["a"] + n["b"],
    "remove": lambda n: n["a"] - n["b"],
    "buy": lambda n: n["count"] * n["price"],
    "share": lambda n: n["total"] // n["friends"],
    "add_then_remove": lambda n: n["a"] + n["b"] - n["c"],
    "packs_then_use": lambda n: n["packs"] * n["per_pack"] - n["used"],
    "wage_then_spend": lambda n: n["rate"] * n["hours"] - n["spent"],
}


def test_generator_is_deterministic_by_seed():
    first = generate_problems(50, seed=7)
    assert first == generate_problems(50, seed=7)
    assert [p.meta for p in first] == [p.meta for p in generate_problems(50, seed=7)]
    assert [p.question for p in first] != [p.question for p in generate_problems(50, seed=8)]
    assert generate_problems(20, seed=7) == first[:20]  # a prefix: asking for fewer changes nothing
    assert len({p.question for p in first}) == 50  # no repeats
    assert len({p.id for p in first}) == 50


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_generated_answers_are_right(difficulty):
    problems = generate_problems(400, seed=difficulty, difficulty=difficulty)
    assert {p.meta["template"] for p in problems} == set(EXPECTED) == set(TEMPLATES)
    for p in problems:
        numbers = p.meta["numbers"]
        want = EXPECTED[p.meta["template"]](numbers)
        assert p.answer == str(want), p
        assert want >= 0
        for value in numbers.values():  # every drawn number is in the question
            assert str(value) in p.question
        if p.meta["template"] == "share":
            assert numbers["total"] % numbers["friends"] == 0  # exact division
        assert p.solution.endswith(f"\n#### {want}")
        assert extract_answer(p.solution) == p.answer  # the worked solution scores as correct


def test_default_difficulty_is_mostly_one_step_small_numbers():
    problems = generate_problems(500, seed=0)
    one_step = [p for p in problems if p.meta["template"] in ("add", "remove", "buy", "share")]
    assert len(one_step) / len(problems) > 0.7
    assert max(v for p in one_step for v in p.meta["numbers"].values()) <= 30
    assert max(int(p.answer) for p in one_step) <= 25
    assert max(v for p in problems for v in p.meta["numbers"].values()) < 100
    harder = generate_problems(500, seed=0, difficulty=3)
    assert max(int(p.answer) for p in harder) > 100


def test_train_and_held_out_splits_never_overlap():
    train = generate_problems(600, seed=0, split="train")
    test = generate_problems(150, seed=0, split="test")  # the same seed: the split alone separates them

    def key(p):
        return p.meta["template"], tuple(sorted(p.meta["numbers"].items()))

    assert len(train) == 600 and len(test) == 150
    assert not {p.question for p in train} & {p.question for p in test}
    assert not {key(p) for p in train} & {key(p) for p in test}  # not even the same arithmetic renamed
    assert not {p.question for p in load_problems("generated", split="train", n=300, seed=1)} & {
        p.question for p in load_problems("generated", split="test", n=100, seed=2)
    }


def test_generator_refuses_bad_arguments():
    with pytest.raises(ValueError, match="difficulty"):
        generate_problems(3, difficulty=0)
    with pytest.raises(ValueError, match="n must be"):
        generate_problems(-1)
    assert generate_problems(0) == []


GSM8K_LINES = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
                 "in May. How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
               "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
    {"question": "A big number?", "answer": "It is large.\n#### 1,200"},
]


def test_load_jsonl_reads_gsm8k_lines(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in GSM8K_LINES) + "\n\n", encoding="utf-8")
    problems = load_jsonl(path)
    assert [p.answer for p in problems] == ["72", "10", "1200"]
    assert problems[0].question.startswith("Natalia sold clips")
    assert problems[0].solution == GSM8K_LINES[0]["answer"]
    assert [p.id for p in problems] == ["train.jsonl:1", "train.jsonl:2", "train.jsonl:3"]
    assert {p.meta["source"] for p in problems} == {"jsonl"}
    everything = load_problems("jsonl", path, "train", hash_split=False)
    assert sorted(p.id for p in everything) == sorted(p.id for p in problems)
    halves = [load_problems("jsonl", path, split) for split in ("train", "test")]
    assert sorted(p.id for half in halves for p in half) == sorted(p.id for p in problems)  # a partition


def test_load_jsonl_names_a_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GSM8K_LINES[0]) + "\n" + json.dumps({"question": "q", "answer": "no hashes"}))
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: no '#### <answer>' line"):
        load_jsonl(path)
    path.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_jsonl(path)
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1"):
        load_jsonl(path)


def test_parse_gsm8k_answer():
    assert parse_gsm8k_answer("a\nb\n#### 18") == "18"
    assert parse_gsm8k_answer("#### -5.0\n") == "-5"
    with pytest.raises(ValueError):
        parse_gsm8k_answer("#### ")


def test_auto_falls_back_to_generated_when_datasets_is_missing(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError

    def no_network(timeout_s):
        raise AssertionError("the Hub must not be probed when datasets is missing")

    monkeypatch.setattr(problems_module, "_hub_unreachable_reason", no_network)
    with caplog.at_level(logging.WARNING, logger="integrations.gsm8k.problems"):
        problems = load_problems("auto", split="train", n=5, seed=3)
    assert problems == generate_problems(5, seed=3, split="train")
    assert "the `datasets` package is not installed" in caplog.text
    assert "falling back to generated problems" in caplog.text
    with pytest.raises(RuntimeError, match="GSM8K could not be loaded"):
        load_problems("gsm8k", split="train", n=5)


def fake_datasets(load_dataset):
    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset
    return module


def test_auto_falls_back_when_the_hub_is_unreachable(monkeypatch, caplog):
    calls = []
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(lambda *a, **k: calls.append(a)))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(problems_module, "_hub_unreachable_reason",
                        lambda timeout_s: "the Hugging Face Hub at https://huggingface.co is unreachable (x)")
    with caplog.at_level(logging.WARNING, logger="integrations.gsm8k.problems"):
        problems = load_problems("auto", split="test", n=4, seed=0)
    assert problems == generate_problems(4, seed=0, split="test")
    assert calls == []  # load_dataset was never tried: it would wait on retries
    assert "Hub at https://huggingface.co is unreachable" in caplog.text


def test_a_failing_load_dataset_is_a_fallback_not_a_crash(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(broken))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: only the cache is asked, no probe
    monkeypatch.setattr(problems_module, "_hub_unreachable_reason",
                        lambda timeout_s: pytest.fail("probed the Hub although HF_HUB_OFFLINE=1"))
    with caplog.at_level(logging.WARNING, logger="integrations.gsm8k.problems"):
        assert load_gsm8k("train") is None
    assert "load_dataset failed (ConnectionError: Couldn't reach" in caplog.text


def test_gsm8k_rows_are_used_when_the_hub_answers(monkeypatch):
    asked = []

    def load_dataset(name, config, split):
        asked.append((name, config, split))
        return GSM8K_LINES[:2]

    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(load_dataset))
    monkeypatch.setattr(problems_module, "_hub_unreachable_reason", lambda timeout_s: None)
    problems = load_problems("auto", split="test", n=None, seed=0)
    assert asked == [("openai/gsm8k", "main", "test")]
    assert sorted(p.answer for p in problems) == ["10", "72"]
    assert all(p.meta["source"] == "gsm8k" and p.id.startswith("gsm8k-test-") for p in problems)


def test_problem_task_is_what_the_rl_api_stores():
    problem = Problem("What is 2 + 3?", "5", "p-1")
    assert problem.task() == {"problem_id": "p-1", "question": "What is 2 + 3?", "answer": "5"}


def test_load_problems_refuses_unknown_sources_and_missing_arguments():
    with pytest.raises(ValueError, match="unknown problem source"):
        load_problems("hub")
    with pytest.raises(ValueError, match="needs a path"):
        load_problems("jsonl")
    with pytest.raises(ValueError, match="need a count"):
        load_problems("generated")
