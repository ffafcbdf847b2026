"""``python -m ar_torchrl.recipes.dapo_ppo [overrides]``: the recipe's command line
(:func:`ar_torchrl.recipes.dapo_ppo.main.cli`, also the console script ``ar-torchrl-dapo``)."""

from ar_torchrl.recipes.dapo_ppo.main import cli

if __name__ == "__main__":
    cli(script=("-m", "ar_torchrl.recipes.dapo_ppo"))
