"""Property-based (hypothesis) test of the recipe's config schema: any value for a handful of typed
keys gives a validated config or an error naming the key (OmegaConf's ValidationError when the
type does not fit, the schema's ValueError/TypeError when the value does not), never another
exception type."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError
from support.fuzz import fuzz
from support.recipe_helpers import load

from ar_torchrl.recipes.dapo_ppo import Config, validate_config

#: Typed keys of ar_torchrl/configs/dapo_ppo.yaml (the timeouts are checked by their own tests).
KEYS = [
    "algo.lr",
    "algo.gamma",
    "algo.ppo_epochs",
    "algo.clip_epsilon",
    "algo.grad_clip",
    "algo.kl_coeff",
    "rollout.max_new_tokens",
    "rollout.prompts_per_iter",
    "rollout.temperature",
    "rollout.top_p",
    "rollout.top_k",
    "rollout.overlong_buffer",
    "rollout.packing",
    "rollout.shared_prefix",
    "train.iterations",
    "train.max_policy_lag",
    "train.eval_prompts",
    "data.holdout",
    "seed",
    "num_threads",
    "device",
]

values = st.one_of(
    st.integers(-3, 10),
    st.integers(),
    st.sampled_from([2**31, 2**63, 10**30, -(10**30)]),
    st.floats(),
    st.sampled_from([0.0, -0.0, 1e-300, 1e300, math.inf, -math.inf, math.nan]),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.sampled_from(["auto", "cpu", "cuda:0", "1e3", "0x10", "${seed}", "${nope}", "null"]),
    st.lists(st.floats(-1, 1) | st.integers(-2, 2), max_size=3),
)


@pytest.fixture(scope="module")
def raw():
    return load()


@fuzz(150)
@given(key=st.sampled_from(KEYS), value=values)
def test_any_value_of_a_typed_key_is_validated_or_refused_naming_the_key(raw, key, value):
    cfg = copy.deepcopy(raw)
    leaf = key.rsplit(".", 1)[-1]
    try:
        OmegaConf.update(cfg, key, value, merge=True)
    except ValidationError as err:  # the schema's type does not fit
        assert f"full_key: {key}" in str(err), err
        return
    try:
        typed = validate_config(cfg)
    except (ValueError, TypeError) as err:
        assert leaf in str(err), (key, value, str(err))
        return
    assert isinstance(typed, Config)
