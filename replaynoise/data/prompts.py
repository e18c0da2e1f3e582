"""The prompt a problem is asked with: one definition for the rollouts a measurement makes and for the prompts a
model is trained on, so that a trained model meets at evaluation the very text it was trained to answer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PROMPT_STYLES = ("chat", "plain")


def ask(question: str, instruction: str) -> str:
    return f"{instruction} {question}".strip() if instruction else question


def chat_turns(question: str, instruction: str, shots: Sequence[Mapping] = ()) -> list[dict]:
    """The conversation of a chat prompt: the worked examples ``shots`` ({question, answer}) as earlier user and
    assistant turns, then the question."""
    turns = [
        turn
        for shot in shots
        for turn in (
            {"role": "user", "content": ask(shot["question"], instruction)},
            {"role": "assistant", "content": shot["answer"]},
        )
    ]
    return [*turns, {"role": "user", "content": ask(question, instruction)}]


def plain_text(question: str, instruction: str, shots: Sequence[Mapping] = ()) -> str:
    """A plain "Question: ... Answer:" prompt for base models, the shots as earlier pairs in the same frame."""
    examples = "".join(
        f"Question: {ask(shot['question'], instruction)}\nAnswer: {shot['answer']}\n\n" for shot in shots
    )
    return f"{examples}Question: {ask(question, instruction)}\nAnswer:"


def check_style(style: str) -> None:
    if style not in PROMPT_STYLES:
        raise ValueError(f"prompt.style must be one of {PROMPT_STYLES}, got {style!r}")


def check_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompt.style is 'chat' but the model has no chat template; use prompt.style: plain")
