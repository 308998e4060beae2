"""Prompt sets: held-out code prompts, and reading prompt files.

A held-out prompt is a file's beginning cut at a line boundary: the longest run of whole lines
whose token count does not exceed the chosen length. Prompt files are JSON lines, either
``{"id": ..., "prompt": "..."}`` or the Spec-Bench format (``{"question_id": ..., "turns":
["...", ...]}``, first turn used).
"""

from __future__ import annotations

import json
from pathlib import Path


def cut_at_line(text: str, tokenizer, max_tokens: int) -> str | None:
    """The longest prefix of whole lines with at most max_tokens tokens (None if the first line
    alone is longer)."""
    lines = text.splitlines(keepends=True)
    counts = [len(ids) for ids in tokenizer(lines, add_special_tokens=False)["input_ids"]] if lines else []
    best, total = None, 0
    for index, count in enumerate(counts):
        total += count
        if total > max_tokens:
            break
        best = index + 1
    if best is None:
        return None
    prefix = "".join(lines[:best])
    # merges across line ends can only shorten the count, but check the real one
    while best and len(tokenizer(prefix, add_special_tokens=False)["input_ids"]) > max_tokens:
        best -= 1
        prefix = "".join(lines[:best])
    return prefix or None


def heldout_prompts(held_out: list[tuple[str, str]], tokenizer, count: int, max_tokens: int, min_tokens: int = 16) -> list[dict]:
    """From (id, text) pairs of held-out files, up to ``count`` prompts of at most max_tokens."""
    prompts = []
    for file_id, text in held_out:
        prompt = cut_at_line(text, tokenizer, max_tokens)
        if prompt is None or len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) < min_tokens:
            continue
        prompts.append({"id": file_id, "prompt": prompt})
        if len(prompts) == count:
            break
    return prompts


def write_jsonl(prompts: list[dict], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for prompt in prompts:
            f.write(json.dumps(prompt, ensure_ascii=False) + "\n")


def read_prompts(path: str | Path) -> list[dict]:
    """JSON lines with a ``prompt`` field, or Spec-Bench's ``turns`` (first turn) -> [{id, prompt}]."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error.msg}); each line must be one JSON object") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object with a 'prompt' or 'turns' field")
            if isinstance(record.get("prompt"), str):
                text = record["prompt"]
            elif isinstance(record.get("turns"), list) and record["turns"] and isinstance(record["turns"][0], str):
                text = record["turns"][0]
            else:
                raise ValueError(
                    f"{where}: needs a string field 'prompt' or a non-empty list of strings 'turns' (Spec-Bench)"
                )
            prompts.append({"id": record.get("id", record.get("question_id", line_number)), "prompt": text})
    if not prompts:
        raise ValueError(f"{path}: no prompts found")
    return prompts
