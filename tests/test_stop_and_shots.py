"""Few-shot prompts and stop texts (``prompt.shots``, ``configs.X.stop``): what a base model needs to give a
gradable answer line, on the real SmolLM2 tokenizer and model (CPU)."""

from __future__ import annotations

import polars as pl
import pytest
from helpers import configuration, rollout_job

from replaynoise.data.datasets import load_problems, sample_problems
from replaynoise.data.loading import load_tokenizer, model_weights_dir, stop_token_ids
from replaynoise.engines import make_engine
from replaynoise.engines.base import ContinuationRequest, ContinuationResult, SamplingSettings
from replaynoise.generation import replay, rollouts
from replaynoise.generation.pivots import PivotRules

SHOTS = [
    {
        "question": "Tom has 7 apples. Tom gets 5 more apples. How many apples does Tom have now?",
        "answer": "7 + 5 = 12. The answer is 12.",
    },
    {
        "question": "Ana has 9 pens. Ana gives away 4 pens. How many pens does Ana have left?",
        "answer": "9 - 4 = 5. The answer is 5.",
    },
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(model_weights_dir(smollm2_dir))


def test_plain_shots_come_before_the_question_in_the_same_frame(tokenizer):
    ids = rollouts.prompt_ids(tokenizer, "Q?", "plain", "Be brief.", SHOTS)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text == (
        "Question: Be brief. " + SHOTS[0]["question"] + "\nAnswer: " + SHOTS[0]["answer"] + "\n\n"
        "Question: Be brief. " + SHOTS[1]["question"] + "\nAnswer: " + SHOTS[1]["answer"] + "\n\n"
        "Question: Be brief. Q?\nAnswer:"
    )
    assert rollouts.prompt_ids(tokenizer, "Q?", "plain", "Be brief.") == rollouts.prompt_ids(
        tokenizer, "Q?", "plain", "Be brief.", []
    )


def test_chat_shots_are_earlier_turns_in_order(tokenizer):
    text = tokenizer.decode(rollouts.prompt_ids(tokenizer, "Q?", "chat", "", SHOTS))
    where = [
        text.index(part)
        for part in (SHOTS[0]["question"], SHOTS[0]["answer"], SHOTS[1]["question"], SHOTS[1]["answer"], "Q?")
    ]
    assert where == sorted(where)
    assert text.count("<|im_start|>assistant") == 3  # two worked answers and the generation prompt


def test_stop_tokens_are_every_text_token_that_holds_the_stop(tokenizer):
    ids = stop_token_ids(tokenizer, ["\n"])
    assert len(ids) > 1  # "\n" alone and tokens that end in or hold one ("\n\n", ".\n", ...)
    assert all("\n" in tokenizer.decode([i]) for i in ids)
    assert not ids & set(tokenizer.all_special_ids)
    others = set(range(len(tokenizer))) - ids - set(tokenizer.all_special_ids)
    assert not any("\n" in tokenizer.decode([i]) for i in list(others)[:5000])
    assert stop_token_ids(tokenizer, []) == set()


def test_a_stop_no_token_holds_is_refused_by_value(tokenizer):
    with pytest.raises(ValueError, match="'\\\\nQuestion: zzqx'"):
        stop_token_ids(tokenizer, ["\nQuestion: zzqx"])


def test_stop_ends_every_rollout_at_its_first_stop_token(smollm2_dir, tmp_path):
    """Plain frame with shots: the instruct model writes on past its answer line like a base model; with the
    stop each response ends at its first newline token, without it some go past one."""
    problems = sample_problems(load_problems("simple_addsub", None, tmp_path), 3, 7)
    rules = PivotRules(max_margin=0.3, per_rollout=2)

    def responses(stop: list[str]):
        engine = make_engine(configuration(stop=stop), smollm2_dir, topk=5, threads=2)
        job = rollout_job(
            "c",
            7,
            SamplingSettings(0.7, 1.0, 32),
            rules,
            style="plain",
            instruction="",
            shots=SHOTS,
            per_problem=2,
            batch_size=6,
        )
        frame = rollouts.generate(
            engine, problems, job, kv_dir=tmp_path / f"kv{len(stop)}", work_dir=tmp_path / f"work{len(stop)}"
        )
        return engine, frame

    engine, stopped = responses(["\n"])
    stops = engine.stop_ids
    for ids, finish, special in zip(stopped["response_ids"], stopped["finish_reason"], stopped["special_ids"]):
        inside = [t for t in ids[:-1] if t in stops]
        assert not inside
        assert (finish == "eos") == (ids[-1] in engine.eos_ids)  # stop tokens are among the engine's ends
        assert stops <= set(special)  # no pivot substitutes a stop token, as none substitutes end of sequence
    assert any(ids[-1] in stops for ids in stopped["response_ids"])
    _, free = responses([])
    assert any(any(t in stops for t in ids[:-1]) for ids in free["response_ids"])


def test_graded_text_ends_at_a_stop_branch_token(tokenizer):
    """A pivot whose branch token is the stop: whatever the engine samples after it is not the answer."""
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    stops = stop_token_ids(tokenizer, ["\n"])
    assert newline in stops
    prompt = tokenizer.encode("Question: 2 + 3?\nAnswer:", add_special_tokens=False)
    answer = tokenizer.encode(" 5", add_special_tokens=False)
    after = tokenizer.encode("Question: 4 + 4?\nAnswer: 8", add_special_tokens=False)
    req = ContinuationRequest(
        pivot_id="p/r0@2", branch="original", k=0, seed=1, prefix_ids=tuple(prompt + answer), branch_token=newline
    )
    res = ContinuationResult(
        token_ids=after,
        finish_reason="length",
        verified=True,
        prefix_len=len(prompt) + 2,
        next_topk_ids=[1],
        next_topk_logprobs=[0.0],
        next_digest="d",
    )
    rollouts = pl.DataFrame({"problem_id": ["q"], "gold": ["5"]})
    pivots = pl.DataFrame({"pivot_id": ["p/r0@2"], "problem_id": ["q"], "t": [len(answer)]})
    (cut,) = replay.Grader(tokenizer, rollouts, pivots, stops).records([req], [res], "decode_kv", 0, 1)
    assert cut["text"] == " 5\n" and cut["answer"] == "5" and cut["correct"]
    (uncut,) = replay.Grader(tokenizer, rollouts, pivots, frozenset()).records([req], [res], "decode_kv", 0, 1)
    assert uncut["answer"] == "8" and not uncut["correct"]
