"""ar_torchrl.utils.checks: the shared argument checks (light: no torch import)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ar_torchrl.utils.checks import check_choice, check_clip_epsilon, check_grad_clip, check_number


def test_check_number_bounds_types_and_messages():
    assert check_number("o", "x", 3, ge=1, integer=True) == 3
    assert check_number("o", "x", None, allow_none=True) is None
    with pytest.raises(TypeError, match=r"o: x must be an integer, got True \(bool\)"):
        check_number("o", "x", True, integer=True)
    with pytest.raises(TypeError, match=r"o: x must be a number, got 'abc' \(str\)"):
        check_number("o", "x", "abc")
    with pytest.raises(ValueError, match=r"o: x must be finite, got nan"):
        check_number("o", "x", float("nan"))
    with pytest.raises(ValueError, match=r"o: x must be >= 0 and <= 1, got 1.5"):
        check_number("o", "x", 1.5, ge=0, le=1)
    with pytest.raises(ValueError, match=r"o: x must be > 0, got 0"):
        check_number("o", "x", 0, gt=0)


def test_clip_epsilon_and_grad_clip():
    assert check_clip_epsilon("o", 0.2) == 0.2
    assert check_clip_epsilon("o", (0.2, 1.5)) == (0.2, 1.5)  # a large eps_high is legal
    for bad in (0.0, 1.0, (0.0, 0.2), (0.2, 0.0), (0.1, 0.2, 0.3), "0.2", (True, 0.2)):
        with pytest.raises(ValueError, match="clip_epsilon must be"):
            check_clip_epsilon("o", bad)
    assert check_grad_clip("o", None) is None and check_grad_clip("o", 2) == 2.0
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="grad_clip must be"):
            check_grad_clip("o", bad)
    with pytest.raises(ValueError, match=r"o: mode='x' is not one of \['a', 'b'\]"):
        check_choice("o", "mode", "x", ["a", "b"])


def test_checks_module_does_not_import_torch():
    code = "import sys, ar_torchrl.utils.checks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_group_checks_return_normalised_values_and_name_the_owner():
    from ar_torchrl.utils.checks import (
        check_actor_args,
        check_gae_args,
        check_grpo_args,
        check_optimizer_args,
        check_ppo_loss_args,
        check_ppo_update_args,
    )

    assert check_gae_args(gamma=1, lmbda=0.95)["gamma"] == 1.0
    loss = check_ppo_loss_args("algo", clip_epsilon=[0.2, 0.28], clip_value=None, critic_coeff=0)
    assert loss["clip_epsilon"] == (0.2, 0.28) and loss["clip_value"] is None
    assert check_ppo_update_args(epochs=2, num_minibatches=4, grad_clip=None)["grad_clip"] is None
    assert check_grpo_args(scale=False)["scale"] is False
    assert check_actor_args(temperature=0.7)["temperature"] == 0.7
    assert check_optimizer_args("algo", lr=1e-3, value_lr=0.0)["value_lr"] == 0.0
    for call, msg in [
        (lambda: check_gae_args("algo", gamma=1.5), r"algo: gamma must be >= 0 and <= 1, got 1.5"),
        (
            lambda: check_gae_args("algo", adaptive_lmbda_alpha=0),
            r"adaptive_lmbda_alpha must be > 0",
        ),
        (
            lambda: check_ppo_loss_args("algo", dual_clip=1.0),
            r"algo: dual_clip must be > 1, got 1.0",
        ),
        (
            lambda: check_ppo_loss_args("algo", loss_agg_mode="sum"),
            r"loss_agg_mode='sum' is not one of",
        ),
        (lambda: check_optimizer_args("algo", lr=-1e-3), r"algo: lr must be > 0, got -0.001"),
        (
            lambda: check_optimizer_args("algo", lr=1e-3, weight_decay=-1),
            r"weight_decay must be >= 0",
        ),
        (
            lambda: check_ppo_update_args("algo", grad_clip=-1),
            r"algo: grad_clip must be > 0, got -1",
        ),
    ]:
        with pytest.raises(ValueError, match=msg):
            call()
    with pytest.raises(
        TypeError, match=r"algo: normalize_advantage must be true or false, got 'false'"
    ):
        check_gae_args("algo", normalize_advantage="false")


def test_library_and_checks_give_the_same_message():
    """The library classes raise exactly what the shared checks raise (one source of ranges)."""
    from support.trajectories import tiny_actor_critic

    from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
    from ar_torchrl.utils.checks import check_gae_args, check_ppo_loss_args

    ac = tiny_actor_critic()
    for lib, shared in [
        (lambda: TokenPPOLoss(ac, clip_value=-1.0), lambda: check_ppo_loss_args(clip_value=-1.0)),
        (lambda: TokenPPOLoss(ac, kl_coeff=-1.0), lambda: check_ppo_loss_args(kl_coeff=-1.0)),
        (lambda: TokenGAE(lmbda=2.0), lambda: check_gae_args(lmbda=2.0)),
    ]:
        with pytest.raises(ValueError) as a:
            lib()
        with pytest.raises(ValueError) as b:
            shared()
        assert str(a.value) == str(b.value)


def test_an_owner_ending_with_a_dot_names_a_config_key():
    """The recipe's schemas call the library's checks with their config key prefix."""
    from ar_torchrl.utils.checks import check_optimizer_args, check_ppo_loss_args

    with pytest.raises(ValueError, match=r"^config: algo.lr must be > 0, got -0.001$"):
        check_optimizer_args("config: algo.", lr=-1e-3)
    with pytest.raises(ValueError, match=r"^config: algo.clip_epsilon must be a float"):
        check_ppo_loss_args("config: algo.", clip_epsilon=(0.2, 0.0))
    with pytest.raises(ValueError, match=r"^TokenPPOLoss: clip_epsilon must be a float"):
        check_ppo_loss_args(clip_epsilon=(0.2, 0.0))


# ----------------------------------------------------------------------------- one check per option
def core(message: str, key: str) -> str:
    """What a check says about ``key`` after naming it (``"config: algo.lmbda"`` and
    ``"TokenGAE: lmbda"`` both say ``" must be >= 0 and <= 1, got "``): the text from the key to
    the value received."""
    after = message.split(key, 1)[1]
    return after.split(" got ")[0]


def raised(fn) -> str:
    with pytest.raises((ValueError, TypeError)) as info:
        fn()
    return str(info.value)


def test_the_config_and_the_constructor_raise_the_same_check():
    """Each option is checked by one function, which the config schema's check and the class both
    call: the two errors differ only in how they name the key (and the value's spelling)."""
    from support.recipe_helpers import typed
    from support.trajectories import make_trajectory, tiny_actor_critic

    from ar_torchrl.backends import SamplingParams
    from ar_torchrl.backends.sglang import SGLangBackend, SGLangClientOptions
    from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
    from ar_torchrl.tools import TagParser, Toolbox
    from ar_torchrl.training import plan_micro_batches

    td = make_trajectory([2, 3], [3, 2])
    cases = {
        "clip_epsilon": (
            lambda: typed(["algo.clip_epsilon=[1.5,0.2]"]),
            lambda: TokenPPOLoss(tiny_actor_critic(), clip_epsilon=(1.5, 0.2)),
        ),
        "lmbda": (lambda: typed(["algo.gae.lmbda=1.5"]), lambda: TokenGAE(lmbda=1.5)),
        "token_budget": (
            lambda: typed(["rollout.token_budget=0"]),
            lambda: plan_micro_batches(td, token_budget=0),
        ),
        "top_p": (lambda: typed(["rollout.top_p=0"]), lambda: SamplingParams(top_p=0.0)),
        "timeout_s": (
            lambda: typed(["tools.timeout_s=0"], name="tool_arithmetic"),
            lambda: Toolbox([], TagParser(), timeout_s=0),
        ),
        "sync_timeout_s": (
            lambda: typed(["backend=sglang", "backend.sync_timeout_s=1e10"]),
            lambda: SGLangBackend(
                "http://127.0.0.1:9", options=SGLangClientOptions(sync_timeout_s=1e10)
            ),
        ),
    }
    for key, (config, constructor) in cases.items():
        a, b = raised(config), raised(constructor)
        assert a.startswith("config: ") and f".{key}" in a, a
        assert core(a, key) == core(b, key), (a, b)


@pytest.mark.parametrize(
    ("overrides", "name", "key"),
    [
        (["tools.timeout_s=1e10"], "tool_arithmetic", "tools.timeout_s"),
        (["backend=sglang", "backend.timeout_s=1e10"], "dapo_ppo", "backend.timeout_s"),
        (["backend=sglang", "backend.sync_timeout_s=1e10"], "dapo_ppo", "backend.sync_timeout_s"),
        (["backend=sglang", "backend.stall_grace_s=1e10"], "dapo_ppo", "backend.stall_grace_s"),
        (["dist.timeout_s=1e10"], "dapo_ppo", "dist.timeout_s"),
        (
            [
                "backend=sglang",
                "backend.weight_sync=distributed",
                "+backend.weight_sync_options.timeout_s=1e10",
            ],
            "dapo_ppo",
            "backend.weight_sync_options.timeout_s",
        ),
    ],
)
def test_huge_timeouts_are_refused_naming_the_key(overrides, name, key):
    """N6: 1e10 passed the `> 0` checks, then raised OverflowError at the first wait."""
    from support.recipe_helpers import typed

    with pytest.raises(
        ValueError, match=rf"^config: {key} must be <= 604800 \(seconds: a week\), got 1"
    ):
        typed(overrides, name=name)


def test_huge_timeouts_are_refused_by_the_library_too():
    import threading

    from ar_torchrl.backends.sglang import SGLangBackend
    from ar_torchrl.tools import TagParser, Toolbox
    from ar_torchrl.utils.checks import MAX_TIMEOUT_S, check_timeout

    assert MAX_TIMEOUT_S < threading.TIMEOUT_MAX  # what a week must stay under
    assert check_timeout("o", "t", MAX_TIMEOUT_S) == MAX_TIMEOUT_S
    assert check_timeout("o", "t", None, allow_none=True) is None
    with pytest.raises(
        ValueError, match=r"^Toolbox: timeout_s must be <= 604800 .*\(None: no deadline\)$"
    ):
        Toolbox([], TagParser(), timeout_s=1e10)
    for key in ("timeout_s", "sync_timeout_s", "connect_timeout_s", "stall_grace_s"):
        with pytest.raises(ValueError, match=rf"^SGLangBackend: {key} must be <= 604800"):
            SGLangBackend("http://127.0.0.1:9", **{key: 1e10})  # the 0.1 keywords: same checks
