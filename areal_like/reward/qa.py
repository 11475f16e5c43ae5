"""Question-answering rewards: exact match and token F1 after SQuAD normalisation (Search-R1's scorer).

    normalize_answer   lower-case → drop punctuation → drop the articles a/an/the → collapse whitespace
                       (SQuAD v1.1's evaluate script, which verl's search_r1_like_qa_em copies)
    extract_answer     the last <answer>…</answer> of the completion (Search-R1's format), else None
    parse_targets      ground truth → list of acceptable answers: a plain string, a JSON list, verl
                       Search-R1's {"target": [...]} (a dict, JSON, or the Python repr a parquet struct
                       becomes when the dataset loader str()s it)
    search_r1_score    verl's search_r1_like_qa_em (the searchR1_* data sources): 0 without an <answer>
                       tag; 1.0 if the last tag's answer matches a target (÷ 4 when the completion holds
                       more than 10 <answer> or </answer> tags); format_score if it does not
    qa_em_score        our own sources (nq, triviaqa, popqa, hotpotqa, qa_em): as search_r1_score, except
                       that a completion with no tag at all is scored as a whole (stripped) — for prompts
                       that do not ask for the tag
    qa_f1_score        the best token F1 over the targets (no format credit: F1 already grades partly)
This module knows nothing of processes or timeouts (fn.py runs it in the reward pool).
"""

from __future__ import annotations

import ast
import json
import re
import string
from collections import Counter
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation, in SQuAD's order (punctuation before articles: "the-end" → "theend")."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def extract_answer(solution_str: str) -> str | None:
    """The stripped text of the last `<answer>…</answer>`; None if there is none."""
    found = _ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def parse_targets(ground_truth: Any) -> list[str]:
    """Every acceptable answer as a string (see the module doc for the accepted forms)."""
    gt = ground_truth
    if isinstance(gt, str):
        s = gt.strip()
        if s[:1] in ("[", "{"):
            # JSON first; then a Python literal, which is what a parquet struct/list becomes after str()
            # (single quotes). literal_eval evaluates literals only, never code.
            for load in (json.loads, ast.literal_eval):
                try:
                    gt = load(s)
                    break
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    continue
    if isinstance(gt, dict):
        if "target" not in gt:
            raise ValueError(f"QA ground_truth dict has no 'target' key (keys {sorted(map(str, gt))}): "
                             "write it as {'target': [answer, ...]} (verl Search-R1) or a list of answers")
        gt = gt["target"]
    if isinstance(gt, (str, bytes)):
        return [gt.decode() if isinstance(gt, bytes) else gt]
    try:
        return [str(t) for t in gt]  # list, tuple, numpy array of answers
    except TypeError:
        return [str(gt)]


def em_check(prediction: str, targets: list[str]) -> bool:
    pred = normalize_answer(prediction)
    return any(normalize_answer(t) == pred for t in targets)


def token_f1(prediction: str, target: str) -> float:
    """SQuAD token F1 of one prediction against one target (after normalisation)."""
    pred_toks, gold_toks = normalize_answer(prediction).split(), normalize_answer(target).split()
    if not pred_toks or not gold_toks:
        return float(pred_toks == gold_toks)  # both empty: 1; one empty: 0
    common = sum((Counter(pred_toks) & Counter(gold_toks)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_toks), common / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def qa_em_score(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0) -> float:
    targets = parse_targets(ground_truth)
    answer = extract_answer(solution_str)
    if answer is None:  # not well-formed: no format credit, but a bare correct answer still counts
        return score if em_check(solution_str.strip(), targets) else 0.0
    return score if em_check(answer, targets) else format_score


def search_r1_score(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0) -> float:
    """verl's Search-R1 EM: the tag is required (a policy must not learn to skip the format), and a
    completion spamming more than 10 answer tags keeps a quarter of the score."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    if not em_check(answer, parse_targets(ground_truth)):
        return format_score
    spam = solution_str.count("<answer>") > 10 or solution_str.count("</answer>") > 10
    return score / 4 if spam else score


def qa_f1_score(solution_str: str, ground_truth: Any) -> float:
    targets = parse_targets(ground_truth)
    answer = extract_answer(solution_str)
    pred = solution_str.strip() if answer is None else answer
    return max((token_f1(pred, t) for t in targets), default=0.0)
