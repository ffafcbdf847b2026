"""A scripted rollout backend for env and collector tests."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

from ar_torchrl.backends import Completion, GenerationBackend, TransformersBackend


class ScriptedBackend(GenerationBackend):
    """Test double that follows the GenerationBackend protocol exactly (prompt-major, ``n`` per
    prompt, one log-prob per token, EOS kept with ``"stop"``, capped with ``"length"``) but answers
    from a script, so that correct answers (which a random tiny model never writes) can be scored.
    Sample ``j`` of a prompt "What is a + b?" answers ``answer(a, b, j)`` (default ``a + b + j``:
    sample 0 is right).
    """

    def __init__(
        self,
        tokenizer,
        answer: Callable[[int, int, int], int] = lambda a, b, j: a + b + j,
        sender=None,
    ):
        super().__init__(sender)
        self.tokenizer, self.answer = tokenizer, answer

    def _generate(self, prompts, n, sampling):
        out = []
        for i, prompt in enumerate(prompts):
            a, b = map(
                int, re.search(r"What is (\d+) \+ (\d+)\?", self.tokenizer.decode(prompt)).groups()
            )
            for j in range(n):
                text = f"Answer: {self.answer(a, b, j)}"
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [
                    self.tokenizer.eos_token_id
                ]
                cut = ids[: sampling.max_new_tokens]
                out.append(
                    Completion(
                        i, cut, [-0.5] * len(cut), "stop" if len(cut) == len(ids) else "length"
                    )
                )
        return out


class PausingBackend(TransformersBackend):
    """The real trainside backend; its decode loop, after ``pause_after`` forwards, signals
    ``reached`` and spins until a weight sync has asked to interrupt it (so that the sync lands
    mid-generation deterministically: a test double of the timing, not of the protocol)."""

    def __init__(self, *args, pause_after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.pause_after, self.forwards = pause_after, 0
        self.reached = threading.Event()

    def _forward(self, *args, **kwargs):
        self.forwards += 1
        if self.forwards == self.pause_after:
            self.reached.set()
            deadline = time.monotonic() + 120
            while not self.interrupted:  # a sync is on its way (the test issues it)
                assert time.monotonic() < deadline, "no weight sync interrupted the generation"
                threading.Event().wait(0.001)
        return super()._forward(*args, **kwargs)
