"""Loads a shipped task's JSONL (beside this file) for lm-eval's `custom_dataset`; written by
data/make_eval_tasks.py."""

from pathlib import Path


def load(file: str, **_metadata):
    import datasets  # optional and heavy (lm-eval's): loaded only when lm-eval reads a task

    path = str(Path(__file__).resolve().parent / file)
    return datasets.DatasetDict({"test": datasets.Dataset.from_json(path)})
