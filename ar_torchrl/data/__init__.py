"""Micro-batch planning, datasets and tasks (registered), and collation to the token trajectory.

Names are imported on first use: the datasets, tasks and the task registry need no torch.
"""

from __future__ import annotations

from ar_torchrl._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["MicroBatch", "MicroBatchPlan", "Plan", "plan_micro_batches"], "micro_batch"),
    "completions_to_trajectory": "collate",
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
