"""Rollout records and prompt sources: samples and segments, the one builder of the token
trajectory, padding to a common width, datasets and tasks (registered), prompt checks.

The ground floor beside :mod:`ar_torchrl.functional`: nothing here imports a backend, a module or
the training layer. Names are imported on first use: the datasets, tasks and the task registry need
no torch.
"""

from __future__ import annotations

from ar_torchrl._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["ROW_KEYS", "pad_trajectories"], "pad"),
    **dict.fromkeys(
        [
            "DAPO_TEMPLATE",
            "SHORT_TEMPLATE",
            "MathDataset",
            "arithmetic_dataset",
            "load_dapo_math",
            "make_row",
            "train_holdout_split",
            "validate_row",
        ],
        "datasets",
    ),
    "arithmetic_task_split": "tasks",
    **dict.fromkeys(["PromptCheck", "check_prompts", "prompt_token_ids"], "prompts"),
    "TASKS": "registry",
    "register_task": "registry",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
