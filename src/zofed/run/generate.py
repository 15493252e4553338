"""Generate with a finished run's model: each prompt is an instruction, written in the run's prompt format (its chat
template or its text template, as the run trained), and answered greedily."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from zofed.data.causal_lm import CausalLM
from zofed.data.dataset import DataError
from zofed.data.generation import progress_bar
from zofed.run.config import ConfigError
from zofed.run.setup import load_run

Prompt = str | Mapping[str, str]  # an instruction, or an example's fields (instruction, context)


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a file: JSON lines with an instruction field (and optionally context), or else one plain
    instruction per non-empty line."""
    path = Path(path)
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix.lower() != ".jsonl":
        return lines
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not a JSON object ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("instruction"), str):
            raise DataError(f"{path}:{number}: a prompt line needs an \"instruction\" text field")
        prompts.append({k: str(v) for k, v in record.items() if k in ("instruction", "context")})
    return prompts


def generate_from_run(run_dir: str | Path, prompts: Sequence[Prompt], max_new_tokens: int = 128, *,
                      batch_size: int = 16, show_progress: bool = False) -> list[str]:
    """The run's greedy response to each prompt (at most `max_new_tokens` tokens), in the order given."""
    setup = load_run(run_dir)
    task = setup.task
    if not isinstance(task, CausalLM):
        raise ConfigError(f"{run_dir} is a {setup.config.task.type} run; generation needs task.type causal-lm")
    task.config = task.config.model_copy(update={"max_new_tokens": max_new_tokens})
    fields = [{"instruction": p} if isinstance(p, str) else dict(p) for p in prompts]
    if not fields:
        return []
    ids = [task.generation_prompt(task.prompt(f)) for f in fields]
    with progress_bar(len(ids), "generating", show=show_progress) as progress:
        return task.generate(setup.model, ids, batch_size, progress)
