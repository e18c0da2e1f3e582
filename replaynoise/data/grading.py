"""Numbers and answers: parsing a number however it is written, extracting a response's final answer, grading
it against the gold answer (exactly, with a relative tolerance, or by math-verify)."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

# ---------------------------------------------------------------------------------------------------- numbers

_LATEX_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox|textnormal)\s*\{([^{}]*)\}")
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]+)\}\s*\{([^{}]+)\}")
_LATEX_NOISE = ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\;", "\\ ", "\\left", "\\right", "{,}")
_PLAIN_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|[-+]?\.\d+"
_WHOLE_NUMBER = re.compile(
    rf"(?P<num>{_PLAIN_NUMBER})(?:\s*/\s*(?P<den>{_PLAIN_NUMBER}))?(?P<units>\s*[A-Za-z][A-Za-z .]*)?"
)


def _clean_number_text(text: str) -> str:
    """Strip the currency, percent and LaTeX dressing that models and datasets put around a number."""
    t = text.strip().replace("\u2212", "-")
    t = _LATEX_FRAC.sub(r"(\1)/(\2)", t)
    t = _LATEX_WRAPPERS.sub(r" \1", t)
    for noise in _LATEX_NOISE:
        t = t.replace(noise, "" if noise != "\\ " else " ")
    t = re.sub(r"\((\s*[-+]?[\d.,]+\s*)\)", r"\1", t)  # (3)/(4) from \frac{3}{4}
    return t.strip().rstrip(".").strip()


def _decimal_fraction(token: str) -> Fraction:
    return Fraction(Decimal(token.replace(",", "")))


def parse_number(text: str, allow_units: bool = False) -> Fraction | None:
    """The exact value of a string that is one number (``1,234``, ``$18``, ``2.50``, ``3/4``, ``\\frac{3}{4}``).

    Exact fractions, not floats, so ``0.1 + 0.2`` style errors and huge integers cannot make a right
    answer compare unequal. ``allow_units`` accepts trailing words (``18 dollars``) in model answers;
    gold answers are parsed strictly.
    """
    match = _WHOLE_NUMBER.fullmatch(_clean_number_text(text))
    if match is None or (match["units"] and not allow_units):
        return None
    try:
        value = _decimal_fraction(match["num"])
        if match["den"] is not None:
            den = _decimal_fraction(match["den"])
            if den == 0:
                return None
            value /= den
    except (InvalidOperation, ValueError):
        return None
    return value


def format_number(value: Fraction) -> str:
    """One canonical text per value: ``18``, ``2.5``, ``-0.75``; a repeating value stays ``1/3``."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    digits = 0
    while (value * 10**digits).denominator != 1:
        digits += 1
    return f"{Decimal(value.numerator) / Decimal(value.denominator):.{digits}f}"


def normalise_number(text: str, allow_units: bool = False) -> str | None:
    value = parse_number(text, allow_units=allow_units)
    return None if value is None else format_number(value)


def gold_from_gsm8k(answer: str) -> str:
    """GSM8K puts the gold number after the last ``#### `` of the worked solution, with thousands commas."""
    if "####" not in answer:
        raise ValueError(f"no '####' marker in GSM8K answer {answer[-80:]!r}")
    tail = answer.rsplit("####", 1)[1].strip()
    gold = normalise_number(tail)
    if gold is None:
        raise ValueError(f"GSM8K gold answer {tail!r} is not a number")
    return gold


def parse_gold(value: Any) -> str:
    """A gold answer in any of the accepted forms (``#### N`` text, a number, numeric text) as canonical text."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"gold answer {value!r} is not a number")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"gold answer {value!r} is not a number")
        return format_number(Fraction(Decimal(repr(value))))  # repr: 3.33333 stays 3.33333
    if isinstance(value, str):
        if "####" in value:
            return gold_from_gsm8k(value)
        gold = normalise_number(value)
        if gold is None:
            raise ValueError(f"gold answer {value!r} is not a number")
        return gold
    raise ValueError(f"gold answer {value!r} ({type(value).__name__}) is not a number")


# --------------------------------------------------------------------------------------- answers and grading

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations: 2/2=<<2/2=1>>1
_MARKER = re.compile(r"####|\banswer\s*(?:is|:|=)\s*:?", re.IGNORECASE)
_NUMBER_IN_TEXT = re.compile(
    r"(?:(?<![\w)\]}])[-\u2212])?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+(?![\d.,]\d))?"
    r"|(?<![\w.])\.\d+"
)


def _last_boxed(text: str) -> tuple[int, int] | None:
    """The span of the content of the last ``\\boxed{...}``, counting braces so ``\\boxed{\\frac{1}{2}}`` is whole,
    without its surrounding blanks."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                content = text[start:i]
                lo = start + len(content) - len(content.lstrip())
                return lo, max(lo, start + len(content.rstrip()))
    return None  # only unclosed boxes: treat as no box at all


def _numbers(text: str) -> Iterator[tuple[str, int, int]]:
    """Each number of ``text`` that parses: its canonical text and its span."""
    for match in _NUMBER_IN_TEXT.finditer(text):
        value = normalise_number(match.group())
        if value is not None:
            yield value, match.start(), match.end()


def _after_marker(text: str) -> tuple[str, int, int] | None:
    """The first number on the line after the last answer marker that is followed by one."""
    for match in reversed(list(_MARKER.finditer(text))):
        rest = text[match.end() :].split("\n", 1)[0]
        first = next(_numbers(rest), None)
        if first is not None:
            return first[0], match.end() + first[1], match.end() + first[2]
    return None


def graded_answer(text: str) -> tuple[str, int, int] | None:
    """The model's final answer and its character span in ``text``: the last box, else an explicit answer marker,
    else the last number. One function gives both, so that a rule on the answer's tokens acts on the tokens the
    grader read (``2 + 10`` after ``\\boxed{12}`` is not the answer).

    Numbers come back canonical (``$1,234.50`` -> ``1234.5``) so that equal answers have equal text;
    a box that holds no plain number (``\\sqrt{2}``) comes back as written for symbolic grading.
    """
    boxed = _last_boxed(text)
    if boxed is not None and boxed[1] > boxed[0]:
        content = text[boxed[0] : boxed[1]]
        return normalise_number(content, allow_units=True) or content, *boxed
    kept: list[int] = []  # the positions of the text without the calculator's annotations, to map a span back
    at = 0
    for match in _CALCULATOR.finditer(text):
        kept += range(at, match.start())
        at = match.end()
    kept += range(at, len(text))
    stripped = "".join(text[i] for i in kept) if len(kept) < len(text) else text
    found = _after_marker(stripped) or next(reversed(list(_numbers(stripped))), None)
    if found is None:
        return None
    return found[0], kept[found[1]], kept[found[2] - 1] + 1


def extract_answer(text: str) -> str | None:
    """The model's final answer (``graded_answer``'s text)."""
    found = graded_answer(text)
    return None if found is None else found[0]


#: Relative tolerance of numeric grading: absorbs rounding in printed decimals, not real differences.
REL_TOL = Fraction(1, 10**6)


def _numbers_equal(a: Fraction, b: Fraction) -> bool:
    return a == b or abs(a - b) <= REL_TOL * max(abs(a), abs(b))


def _math_verify_equal(pred: str, gold: str) -> bool:
    """Symbolic grading for what is not a plain number. math_verify times out via SIGALRM, which only the
    main thread may use, so elsewhere it runs without a timeout rather than failing every answer."""
    import math_verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None

    def parse(s: str) -> list:
        for candidate in (f"${s}$", s):  # bare LaTeX such as x^2+1 only parses inside math delimiters
            parsed = math_verify.parse(candidate, parsing_timeout=timeout)
            if parsed:
                return parsed
        return []

    gold_parsed, pred_parsed = parse(gold), parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def is_correct(pred: str | None, gold: str) -> bool:
    """Whether a prediction equals the gold answer; never raises, since one odd output must not stop a run."""
    if pred is None:
        return False
    try:
        p, g = parse_number(pred, allow_units=True), parse_number(gold)
        if p is not None and g is not None:
            return _numbers_equal(p, g)
        return _math_verify_equal(pred, gold)
    except Exception:  # noqa: BLE001 - grading failures count as wrong, by contract
        return False
