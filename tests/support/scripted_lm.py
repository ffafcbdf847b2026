"""A scripted HF causal LM for tool-use episodes, and the TorchRL side of such an episode.

:class:`ScriptedToolLM` is a real ``Qwen3ForCausalLM`` (config, ``generate``, ``GenerationMixin``)
whose forward puts all the probability on the next character of a script, read from the whole
context (no KV cache): on an assistant turn that follows a tool answer it writes ``Answer: <tool
answer>``, otherwise the call ``<tool name="calculator">a*b</tool>`` for the first ``a * b`` of the
prompt; every turn ends with ``<|im_end|>``. A random tiny model never writes a tool call, so an
episode that both TorchRL's ``ChatEnv`` and ``ToolEnv`` run the same way needs the script; everything
around it (``TransformersWrapper``, HF ``generate``, TorchRL's env, tool transform and collector,
``ToolEnv``) is the real thing.

:func:`torchrl_tool_env` is a TorchRL user's tool episode: ``DatasetChatEnv`` in history mode, a
tool transform written the TorchRL way (a ``ToolTransformBase`` subclass parsing with TorchRL's
``XMLBlockParser``, running this library's calculator), a transform that ends the dialog on an
answer without a tool call (``terminated``), ``StepCounter`` for the turn cap, and DAPO's reward on
the dialog's assistant text when it ends.
"""

from __future__ import annotations

import re

import torch
from torchrl.data import Unbounded
from torchrl.envs import StepCounter, Transform
from torchrl.envs.llm import DatasetChatEnv
from torchrl.envs.llm.transforms import XMLBlockParser
from torchrl.envs.llm.transforms.tools import ToolTransformBase
from transformers import Qwen3ForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.rewards import dapo_math_reward
from ar_torchrl.tools.calculator import Calculator

ASSISTANT = "<|im_start|>assistant\n"
TOOL = "<|im_start|>tool\n"


class ScriptedToolLM(Qwen3ForCausalLM):
    """See the module docstring (logits: 0, and 50 on the scripted next token)."""

    def __init__(self, config, tokenizer) -> None:
        super().__init__(config)
        self.tokenizer = tokenizer
        self.config.use_cache = False
        self.generation_config.use_cache = False
        self.generation_config.pad_token_id = tokenizer.pad_token_id

    def script(self, context: str) -> str:
        head = context.rpartition(ASSISTANT)[0]
        if TOOL in head:
            return "Answer: " + head.rpartition(TOOL)[2].split("<|im_end|>")[0]
        a, b = re.search(r"(\d+) \* (\d+)", head).groups()
        return f'<tool name="calculator">{a}*{b}</tool>'

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        logits = torch.zeros(*input_ids.shape, self.config.vocab_size)
        for b, ids in enumerate(input_ids):
            real = ids if attention_mask is None else ids[attention_mask[b].bool()]
            context = self.tokenizer.decode(real)
            turn = context.rpartition(ASSISTANT)[2]
            ids_script = self.tokenizer(self.script(context), add_special_tokens=False)["input_ids"]
            ids_script = ids_script + [self.tokenizer.eos_token_id]
            done = len(self.tokenizer(turn, add_special_tokens=False)["input_ids"])
            logits[b, -1, ids_script[min(done, len(ids_script) - 1)]] = 50.0
        return CausalLMOutputWithPast(logits=logits)


def scripted_tool_lm(tokenizer) -> ScriptedToolLM:
    return ScriptedToolLM(build_tiny_qwen3(len(tokenizer)).config, tokenizer).eval()


class CalculatorTool(ToolTransformBase):
    """A TorchRL tool transform: ``<tool name="calculator">...</tool>`` calls parsed by TorchRL's
    ``XMLBlockParser`` (a non-JSON body arrives as ``{"raw": body}``), answered by the calculator."""

    def __init__(self) -> None:
        super().__init__()
        self.parser, self.calculator = XMLBlockParser(), Calculator()

    def _process_batch_item(self, content: str, index: int) -> list[str] | None:
        calls = [c for c in self.parser(content)["calls"] if c.tool == "calculator"]
        return [self.calculator(c.args.get("raw", "")) for c in calls] or None


class EndOnAnswer(Transform):
    """Ends a dialog (``terminated``) whose last message is the assistant's, without a tool call
    (a tool transform ran before and appended its answer otherwise); scores it then with DAPO's
    reward on the assistant messages joined by newlines (what ``ToolEnv`` scores), 0 before."""

    def _step(self, tensordict, next_tensordict):
        ended, rewards = [], []
        for history, answer in zip(
            next_tensordict["history", "prompt"].unbind(0), tensordict["answer"]
        ):
            end = history[-1].role == "assistant"
            texts = [h.content for h in history.unbind(0) if h.role == "assistant"]
            text = "\n".join(t.removesuffix("<|im_end|>") for t in texts)
            ended.append(end)
            rewards.append(dapo_math_reward(text, answer) if end else 0.0)
        done = torch.tensor(ended).view(-1, 1)
        next_tensordict["terminated"] = done
        next_tensordict["done"] = next_tensordict["done"] | done
        next_tensordict["reward"] = torch.tensor(rewards).view(-1, 1, 1)
        return next_tensordict

    def transform_reward_spec(self, reward_spec):
        reward_spec["reward"] = Unbounded(reward_spec.shape + (1, 1))
        return reward_spec


def torchrl_tool_env(rows, tokenizer, *, max_turns: int = 3):
    """A TorchRL tool env over ``rows`` (DAPO-schema rows: their user message and ground truth),
    one dialog per env slot, in order."""
    queries = [
        {"query": r["prompt"][-1]["content"], "answer": r["reward_model"]["ground_truth"]}
        for r in rows
    ]
    loader = torch.utils.data.DataLoader(
        queries,
        batch_size=len(queries),
        collate_fn=lambda b: {k: [q[k] for q in b] for k in b[0]},
    )
    env = DatasetChatEnv.from_dataloader(
        loader, batch_size=(len(queries),), tokenizer=tokenizer, input_mode="history"
    )
    env.append_transform(CalculatorTool())
    env.append_transform(EndOnAnswer())
    env.append_transform(StepCounter(max_steps=max_turns))
    return env
