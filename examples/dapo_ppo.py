"""DAPO-math PPO: token-level GAE + value head (or GRPO / RLOO) on an autoregressive LM, with TorchRL.

What it reproduces: the DAPO-Math recipe (arXiv:2503.14476) trained with PPO and a value head
(VAPO-style, arXiv:2504.05118) or with GRPO / RLOO advantages, on any HF causal LM. The CPU default
(configs/dapo_ppo.yaml) is a tiny Qwen3 with a character tokenizer, warm-started on generated
single-digit addition, then trained with PPO; it runs offline and its mean reward clearly rises (the
README gives the figures). The GPU recipe is configs/qwen3_4b_base_dapo_sglang.yaml.

    python examples/dapo_ppo.py                                  # the CPU default
    python examples/dapo_ppo.py algo=grpo train.mode=async       # GRPO, background generation
    python examples/dapo_ppo.py backend=sglang                   # rollouts from a local SGLang server
    python examples/dapo_ppo.py train.resume_from=auto           # continue the newest run of this config
    torchrun --standalone --nproc-per-node 2 examples/dapo_ppo.py  # FSDP2 data parallelism

The recipe itself is library code (ar_torchrl.recipes.dapo_ppo): this script gives it Hydra's
composed configuration and launch, and prints what it reports. Outputs (outputs/<date>/<time>/):
metrics.jsonl, TorchRL logs under logs/, checkpoints/, curves.png. The first Ctrl-C or SIGTERM
finishes the iteration, saves a checkpoint and exits (130 / 143) with the command that resumes.
"""

import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig

from ar_torchrl.recipes import Launch, dapo_ppo  # no torch: --help and bad values answer at once

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@hydra.main(config_path="../configs", config_name="dapo_ppo", version_base="1.3")
def main(raw) -> None:
    hydra_cfg = HydraConfig.get()
    launch = Launch(
        run_dir=Path(hydra_cfg.runtime.output_dir),
        config_name=hydra_cfg.job.config_name,
        default_config_name="dapo_ppo",
        overrides=list(hydra_cfg.overrides.task),
        script=sys.argv[0],
    )
    result = dapo_ppo.run(raw, launch)
    print(*result.lines, sep="\n", file=sys.stderr if result.status == 1 else sys.stdout)
    sys.exit(result.status)


if __name__ == "__main__":
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        sys.exit(print(dapo_ppo.help_text(CONFIGS, sys.argv), end=""))
    try:  # the config's `imports:` (your own components), then a typo'd key, before Hydra
        sys.argv = dapo_ppo.launch_argv(CONFIGS, sys.argv)
    except ValueError as err:
        sys.exit(print(f"{dapo_ppo.PROG}: {err}", file=sys.stderr) or 1)
    for group, name, schema in dapo_ppo.schemas():  # typed keys of every config group option
        ConfigStore.instance().store(group=group, name=name, node=schema)
    main()
