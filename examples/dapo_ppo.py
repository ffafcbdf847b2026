"""DAPO-math PPO: token-level GAE + value head (or GRPO / RLOO) on an autoregressive LM, with TorchRL.

What it reproduces: the DAPO-Math recipe (arXiv:2503.14476) trained with PPO and a value head
(VAPO-style, arXiv:2504.05118) or with GRPO / RLOO advantages, on any HF causal LM. The CPU
default (ar_torchrl/configs/dapo_ppo.yaml) is a tiny Qwen3 with a character tokenizer, warm-started
on generated single-digit addition, then trained with PPO; it runs offline and its mean reward
clearly rises (the README gives the figures). The GPU recipe is
ar_torchrl/configs/qwen3_4b_base_dapo_sglang.yaml.

    python examples/dapo_ppo.py                                  # the CPU default
    python examples/dapo_ppo.py algo=grpo train.mode=async       # GRPO, background generation
    python examples/dapo_ppo.py backend=sglang                   # rollouts from a local SGLang server
    python examples/dapo_ppo.py train.resume_from=auto           # continue the newest run of this config
    torchrun --standalone --nproc-per-node 2 examples/dapo_ppo.py  # FSDP2 data parallelism

The recipe itself is library code (ar_torchrl.recipes.dapo_ppo): this script is its command
line, the same as the installed `ar-torchrl-dapo` and `python -m ar_torchrl.recipes.dapo_ppo`
(docs/install.md). Outputs (outputs/<date>/<time>/): metrics.jsonl, TorchRL logs under logs/,
checkpoints/, curves.png, and the trained policy as a Hugging Face directory, policy/. The first
Ctrl-C or SIGTERM finishes the iteration, saves a checkpoint and exits (130 / 143) with the
command that resumes.
"""

from ar_torchrl.recipes.dapo_ppo.main import cli  # no torch: --help and bad values answer at once

if __name__ == "__main__":
    cli()
